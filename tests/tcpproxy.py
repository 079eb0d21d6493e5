"""A TCP proxy between routers and the test's S3 server that the test can cut, blackhole or make hold
requests: a partition of one box from the bucket while the box keeps serving its clients, and a
write delayed in the network until after someone else took over.

    proxy = BucketProxy("127.0.0.1", server.port)  # listens on 127.0.0.1:<free port> at once
    proxy.start()                                  # its own daemon thread; self.addCleanup(proxy.close)
    env["LCHAT_HIBERNATE_ENDPOINT"] = proxy.endpoint  # the router's S3 traffic now goes through it

    proxy.cut()            # partition, failing fast: every connection reset, new ones too
    proxy.blackhole()      # partition, failing slow: bytes swallowed, clients wait for their timeouts
    proxy.hold(request_matcher("PUT", "/leases/"))  # matching requests are kept back, others flow
    proxy.wait_held(1, timeout=10)                 # blocking; ``await proxy.until_held(1)`` in a test
    proxy.pass_through()                           # heal (held requests stay held)
    released = proxy.release_held()                # the late write: sent upstream now, whoever waits
    released[0].wait_answered(10)                  # -> 200: it landed
    proxy.requests, proxy.stats()                  # what went through, and the counters

The proxy is a plain ``selectors`` loop in a thread of its own, not the Twisted reactor: the clients
it serves are other processes (routers), and it must keep forwarding while the test's reactor thread
is blocked (in a ``deferToThread`` wait, a ``subprocess`` call, ...). Every control method may be
called from any thread; it runs its change on the proxy's thread and returns once it has taken
effect (``cut()`` returns after every open connection has been reset).

Invariants:

- Bytes are forwarded unchanged and in order, per connection and per direction (the S3 signature
  covers the ``Host`` header, which names the proxy: the upstream checks what the client signed).
- The proxy follows HTTP/1.1 framing (``Content-Length`` and chunked bodies, keep-alive, pipelining)
  only to find request and response boundaries; anything it cannot parse (garbage, an upgrade,
  an over-long head) is forwarded as opaque bytes from there on, never refused.
- A held request is buffered whole (head and body) and nothing after it on its connection is
  forwarded before it: per-connection order is kept. It is sent upstream only by
  ``release_held()``, on its own connection if that connection still works, else on a fresh one
  whose answer is discarded: the client having given up does not stop a late write.
- A mode change never loses a held request; only ``close()`` discards them (unsent).
- ``close()`` resets every connection, closes every socket and joins the thread; it is idempotent.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import re
import selectors
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

Predicate = Callable[[str, str, dict[str, str]], bool]
"""``predicate(method, target, headers)``: ``target`` is the request target as sent (percent-encoded
path plus query); header names are lower case, repeated headers joined with ``", "``."""

T = TypeVar("T")

_BACKLOG = 128
_ERROR_BODY_KEPT = 1024  # bytes of an error answer's body kept for a test's failure message
_RECV_SIZE = 256 * 1024
# Stop reading a side while this much waits to be written to the other (or waits behind a held
# request): a slow reader slows its writer down instead of growing our buffers without bound.
_HIGH_WATER = 1024 * 1024
_MAX_HEAD = 64 * 1024  # a head longer than this is not HTTP we follow: forwarded as opaque bytes
_MAX_LINE = 4096  # likewise a chunk-size or trailer line
_COMMAND_TIMEOUT = 10.0
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST, not a FIN

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.[01]")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [\x09\x20-\x7e\x80-\xff]*)?")
_HEADER_NAME = re.compile(_TOKEN)
_REQUEST_FIRST = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]")
_RESPONSE_FIRST = re.compile(rb"H")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,18}")


def request_matcher(method: str | None = None, contains: str = "") -> Predicate:
    """A hold predicate: requests with this method (any when ``None``) whose target contains
    ``contains`` (compare against the percent-encoded form S3 clients send: ``/bucket/key``)."""

    def matches(request_method: str, target: str, headers: dict[str, str]) -> bool:
        return (method is None or request_method == method) and contains in target

    return matches


# -- HTTP/1.1 message boundaries ------------------------------------------------------------------


class _Framing(enum.Enum):
    LENGTH = "length"  # a body of a known length (0 included)
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until close"  # a response without a length: its body ends with the connection
    OPAQUE = "opaque"  # not HTTP we follow (any more): everything from here is passed as it is


class _Event(enum.Enum):
    HEAD = "head"  # a message's head, up to and including the blank line
    DATA = "data"  # bytes of the current message's body (or, outside a message, stray CRLFs)
    END = "end"  # the current message is complete
    OPAQUE = "opaque"  # bytes that are not HTTP we follow


class _State(enum.Enum):
    HEAD = 0
    FRAMING = 1  # a head was returned: the caller must say how its body is framed
    BODY = 2
    CHUNK_SIZE = 3
    CHUNK_DATA = 4
    TRAILER = 5
    UNTIL_CLOSE = 6
    OPAQUE = 7


class _MessageStream:
    """Splits one direction of a connection into HTTP/1.1 messages, byte for byte.

    ``feed`` appends bytes; ``pull`` returns the next event and the bytes it covers, or ``None`` when
    it needs more. Concatenating the bytes of every event returned gives back exactly what was fed
    (what is still buffered comes out of ``drain``). After a ``HEAD`` event the caller parses the
    head and must call ``set_framing`` before pulling again: a response's framing depends on the
    request it answers, which only the caller knows.
    """

    def __init__(self, start_line: re.Pattern[bytes], first_byte: re.Pattern[bytes]) -> None:
        self.buffer = bytearray()
        self._start_line = start_line  # what the first line of a head must be
        self._first_byte = first_byte  # what it can start with (to give up on garbage early)
        self._state = _State.HEAD
        self._remaining = 0

    def feed(self, data: bytes) -> None:
        self.buffer += data

    @property
    def between_messages(self) -> bool:
        return self._state is _State.HEAD and not self.buffer

    def set_framing(self, framing: _Framing, length: int = 0) -> None:
        assert self._state is _State.FRAMING, "set_framing is only for the head just pulled"
        if framing is _Framing.LENGTH:
            self._state, self._remaining = _State.BODY, length
        elif framing is _Framing.CHUNKED:
            self._state = _State.CHUNK_SIZE
        elif framing is _Framing.UNTIL_CLOSE:
            self._state = _State.UNTIL_CLOSE
        else:
            self._state = _State.OPAQUE

    def drain(self) -> bytes:
        """Everything still buffered, as opaque bytes; nothing is parsed after this (end of stream)."""
        data = bytes(self.buffer)
        self.buffer.clear()
        self._state = _State.OPAQUE
        return data

    def _take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def _opaque(self) -> tuple[_Event, bytes]:
        self._state = _State.OPAQUE
        return _Event.OPAQUE, self._take(len(self.buffer))

    def pull(self) -> tuple[_Event, bytes] | None:
        state, buf = self._state, self.buffer
        assert state is not _State.FRAMING, "set_framing must follow a HEAD event"
        if state is _State.OPAQUE:
            return (_Event.OPAQUE, self._take(len(buf))) if buf else None
        if state is _State.HEAD:
            if not buf:
                return None
            if buf.startswith(b"\r\n"):  # stray CRLFs between messages (RFC 9112 2.2 allows them)
                return _Event.DATA, self._take(2)
            if buf == b"\r":
                return None  # the rest of a stray CRLF, probably
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                # Not a head (a TLS hello, binary garbage): pass it on now rather than sit on it
                # until a blank line that may never come.
                line_end = buf.find(b"\r\n")
                if (
                    len(buf) > _MAX_HEAD
                    or not self._first_byte.fullmatch(buf[:1])
                    or (line_end >= 0 and not self._start_line.fullmatch(buf[:line_end]))
                ):
                    return self._opaque()
                return None
            self._state = _State.FRAMING
            return _Event.HEAD, self._take(end + 4)
        if state is _State.BODY:
            if self._remaining == 0:
                self._state = _State.HEAD
                return _Event.END, b""
            if not buf:
                return None
            data = self._take(min(self._remaining, len(buf)))
            self._remaining -= len(data)
            return _Event.DATA, data
        if state is _State.UNTIL_CLOSE:
            return (_Event.DATA, self._take(len(buf))) if buf else None
        if state is _State.CHUNK_DATA:
            if self._remaining == 0:
                self._state = _State.CHUNK_SIZE
                return self.pull()
            if not buf:
                return None
            data = self._take(min(self._remaining, len(buf)))
            self._remaining -= len(data)
            return _Event.DATA, data
        # CHUNK_SIZE or TRAILER: a line at a time.
        end = buf.find(b"\r\n")
        if end < 0:
            return self._opaque() if len(buf) > _MAX_LINE else None
        if state is _State.CHUNK_SIZE:
            size = bytes(buf[:end]).split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size):
                return self._opaque()
            n = int(size, 16)
            if n == 0:
                self._state = _State.TRAILER
            else:
                self._state, self._remaining = _State.CHUNK_DATA, n + 2  # the data and its CRLF
            return _Event.DATA, self._take(end + 2)
        if end == 0:  # the blank line after the trailers: the message is complete
            self._take(2)
            self._state = _State.HEAD
            return _Event.END, b"\r\n"
        return _Event.DATA, self._take(end + 2)


def _parse_head(
    head: bytes, line: re.Pattern[bytes]
) -> tuple[re.Match[bytes], dict[str, str]] | None:
    """The start line's match and the headers (names lower case, repeats joined), or ``None`` when
    this is not an HTTP/1.x head we follow."""
    lines = head[:-4].split(b"\r\n")
    start = line.fullmatch(lines[0])
    if start is None:
        return None
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        name, colon, value = raw.partition(b":")
        if not colon or not _HEADER_NAME.fullmatch(name):  # obs-fold, a space before the colon...
            return None
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return start, headers


def _body_framing(headers: Mapping[str, str], *, request: bool) -> tuple[_Framing, int]:
    """How a message with these headers frames its body (RFC 9112 6.3)."""
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.rsplit(",", 1)[-1].strip().lower() == "chunked":
            return _Framing.CHUNKED, 0
        # A request whose body length cannot be known is an error the upstream must judge.
        return (_Framing.OPAQUE, 0) if request else (_Framing.UNTIL_CLOSE, 0)
    length = headers.get("content-length")
    if length is not None:
        values = {v.strip() for v in length.split(",")}
        value = values.pop()
        if values or not _DIGITS.fullmatch(value):
            return _Framing.OPAQUE, 0
        return _Framing.LENGTH, int(value)
    return (_Framing.LENGTH, 0) if request else (_Framing.UNTIL_CLOSE, 0)


# -- what the test sees ---------------------------------------------------------------------------


class Mode(enum.Enum):
    PASS_THROUGH = "pass through"
    CUT = "cut"
    BLACKHOLE = "blackhole"
    HOLD = "hold"


@dataclass(frozen=True)
class Exchange:
    """One request the proxy saw a head of, and what became of it (a snapshot).

    ``started``/``answered`` are ``time.monotonic()`` (system-wide on Linux: comparable with
    other processes' monotonic stamps); ``started_wall`` is ``time.time()``."""

    method: str
    path: str  # the request target, as sent
    status: int | None  # the upstream's final status; None if none came (yet)
    held: bool  # kept back by hold()
    dropped: bool  # arrived in a blackhole: never forwarded
    lost: (
        bool  # forwarded, but its connection ended before an answer: it may or may not have landed
    )
    started: float
    started_wall: float
    answered: float | None


@dataclass(frozen=True)
class Stats:
    """Counters since the proxy was made (a snapshot). "up" is towards the upstream."""

    connections: int  # connections accepted from clients
    open_connections: int  # client connections open now, plus deliveries of released requests
    upstream_connect_failures: int
    bytes_up: int  # bytes written to the upstream
    bytes_down: int  # bytes written to clients
    bytes_dropped: int  # bytes read and thrown away: blackholed, or answers nobody waits for
    requests_seen: int  # request heads read from clients
    requests_up: int  # requests sent upstream (a released request counts when released)
    requests_held: int
    requests_dropped: int
    responses_down: int  # final response heads read from the upstream


class _Exchange:
    """The mutable record behind an :class:`Exchange`; changed on the proxy thread under its lock."""

    def __init__(self, method: str, path: str, *, held: bool, dropped: bool) -> None:
        self.method = method
        self.path = path
        self.status: int | None = None
        self.held = held
        self.dropped = dropped
        self.lost = False
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.answered: float | None = None
        self.error_body = bytearray()  # the first bytes of a 4xx/5xx answer's body (diagnostics)

    def snapshot(self) -> Exchange:
        return Exchange(
            self.method,
            self.path,
            self.status,
            self.held,
            self.dropped,
            self.lost,
            self.started,
            self.started_wall,
            self.answered,
        )


class HeldRequest:
    """A request kept back by :meth:`BucketProxy.hold`. ``method``, ``path``, ``headers``,
    ``held_at`` (monotonic) and ``held_wall`` never change; the rest is read under the proxy's lock.
    """

    def __init__(self, proxy: BucketProxy, exchange: _Exchange, headers: dict[str, str]) -> None:
        self._proxy = proxy
        self._exchange = exchange
        self.method = exchange.method
        self.path = exchange.path
        self.headers = headers
        self.held_at = exchange.started
        self.held_wall = exchange.started_wall
        self._data = bytearray()  # head and body as the client sent them
        self._complete = False  # the whole body has arrived
        self._pipe: _Pipe | None = None  # the connection it came on, while that still works
        self._released_at: float | None = None
        self._abandoned = False  # released incomplete after its client went away: never sent

    def __repr__(self) -> str:
        return f"<HeldRequest {self.method} {self.path} status={self.status}>"

    @property
    def complete(self) -> bool:
        with self._proxy._cond:
            return self._complete

    @property
    def released_at(self) -> float | None:
        with self._proxy._cond:
            return self._released_at

    @property
    def abandoned(self) -> bool:
        """Released before its body had arrived whole, with its client gone: nothing was sent."""
        with self._proxy._cond:
            return self._abandoned

    @property
    def status(self) -> int | None:
        """The upstream's answer to it once released (whether or not its client got it)."""
        with self._proxy._cond:
            return self._exchange.status

    @property
    def raw(self) -> bytes:
        """The request as its client sent it, head and (once ``complete``) body."""
        with self._proxy._cond:
            return bytes(self._data)

    @property
    def error_body(self) -> bytes:
        """The first bytes of the upstream's answer's body when that answer was an error."""
        with self._proxy._cond:
            return bytes(self._exchange.error_body)

    def wait_answered(self, timeout: float) -> int:
        """Block until the upstream has answered this (released) request; its status."""
        with self._proxy._cond:
            exchange = self._exchange
            if not self._proxy._cond.wait_for(
                lambda: exchange.status is not None or exchange.lost or self._abandoned, timeout
            ):
                raise TimeoutError(f"{self!r}: no answer from the upstream within {timeout:g}s")
            if exchange.status is None:
                why = "its body never arrived whole" if self._abandoned else "its connection ended"
                raise RuntimeError(f"{self!r} got no answer: {why}")
            return exchange.status


# -- the proxy ------------------------------------------------------------------------------------


class _Pipe:
    """One client connection and its upstream connection (or, with ``client`` None, the delivery of
    released requests on a fresh upstream connection whose answers nobody reads).

    Invariant: ``holding`` is the held request whose bytes this pipe is buffering; once it is
    complete nothing more is parsed from ``requests`` until it is released or detached."""

    def __init__(self, number: int, client: socket.socket | None, *, poisoned: bool) -> None:
        self.number = number
        self.client = client
        self.upstream: socket.socket | None = None
        self.connecting = False
        self.to_up = bytearray()
        self.to_client = bytearray()
        self.client_eof = False  # the client sent its FIN
        self.up_eof = False  # the upstream sent its FIN
        self.up_shut = False  # we sent the upstream our FIN
        self.client_shut = False  # we sent the client our FIN
        self.requests = _MessageStream(_REQUEST_LINE, _REQUEST_FIRST)
        self.responses = _MessageStream(_STATUS_LINE, _RESPONSE_FIRST)
        self.holding: HeldRequest | None = None
        self.awaiting: collections.deque[_Exchange] = collections.deque()
        self.poisoned = poisoned  # blackholed: reads are thrown away, nothing is forwarded
        self.closed = False
        self.failing: _Exchange | None = None  # the error answer whose body is arriving now

    @property
    def usable(self) -> bool:
        """Can still carry a request to the upstream and its answer back to the client."""
        return (
            not self.closed
            and not self.poisoned
            and self.client is not None
            and self.upstream is not None
            and not self.up_eof
            and not self.up_shut
        )


class BucketProxy:
    """See the module docstring. ``upstream_host``/``upstream_port``: the S3 server (moto's)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        info = socket.getaddrinfo(upstream_host, upstream_port, type=socket.SOCK_STREAM)[0]
        self._up_family, self._up_address = info[0], info[4]
        self._listener = self._listen()
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._selector = selectors.DefaultSelector()
        self._interest: dict[socket.socket, int] = {}
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        self._watch(self._waker_r, selectors.EVENT_READ, None)
        self._listening = True  # (always: a cut resets what it accepts)
        self._watch(self._listener, selectors.EVENT_READ, None)
        # Everything below is touched by the proxy thread only, or under _cond (the shared records).
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple[Callable[[], Any], threading.Event, list[Any]]]
        self._commands = collections.deque()
        self._command_lock = threading.Lock()
        self._mode = Mode.PASS_THROUGH
        self._predicate: Predicate | None = None
        self._pipes: set[_Pipe] = set()
        self._pipe_numbers = 0
        self._held: list[HeldRequest] = []  # held now, in the order they were held
        self._exchanges: list[_Exchange] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self.errors: list[
            str
        ] = []  # unexpected exceptions in the proxy thread (a test may assert [])
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._torn_down = False

    def __repr__(self) -> str:
        return f"<BucketProxy {self.endpoint} -> {self._up_address} {self._mode.value}>"

    @staticmethod
    def _listen() -> socket.socket:
        # Bound to an explicit port (found free first): Linux keeps an explicitly bound port through
        # the shutdown() that pauses a listener during cut(), but gives an automatic one back to the
        # pool, where another socket could take it. No SO_REUSEADDR, so nobody can share the port.
        for _ in range(50):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            listener = socket.socket()
            try:
                listener.bind(("127.0.0.1", port))
            except OSError as e:
                listener.close()
                if e.errno == errno.EADDRINUSE:
                    continue  # taken between the probe and now: another port
                raise
            listener.listen(_BACKLOG)
            listener.setblocking(False)
            return listener
        raise RuntimeError("no free loopback port for the proxy")

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> BucketProxy:
        """Start forwarding (connections made before are queued by the kernel until now)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"tcpproxy-{self.port}", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Reset every connection, discard held requests, close every socket, join the thread."""
        with self._command_lock:
            if self._closed:
                return
            self._closed = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._submit(self._stop)
            thread.join(_COMMAND_TIMEOUT)
            if thread.is_alive():
                raise RuntimeError(f"{self!r}: the proxy thread did not stop")
        self._teardown()

    def __enter__(self) -> BucketProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control (any thread) ---------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def pass_through(self) -> None:
        """Forward everything (the default). Leaving a blackhole resets the connections that lived
        through it (bytes were dropped: they cannot carry HTTP on); held requests stay held."""
        self._call(lambda: self._set_mode(Mode.PASS_THROUGH, None))

    def cut(self) -> None:
        """A partition that fails fast: every open client connection is reset (RST, and its upstream
        connection with it), and new connections are accepted and reset at once (never
        forwarded: the client sees a reset, as for an answer lost on the way). Not refused: a
        listener shut down to refuse connections frees its port for the kernel to hand to an
        outgoing connection, and the heal's listen() then fails. The port stays bound to the
        proxy throughout. Held requests stay held, and deliveries of released ones carry on
        (those bytes were already on their way)."""
        self._call(lambda: self._set_mode(Mode.CUT, None))

    def blackhole(self) -> None:
        """A partition that fails slowly: connections are accepted, their bytes read and thrown
        away (their request heads logged as ``dropped``), nothing is forwarded either way, and
        clients wait until their own timeouts. Open connections' upstream sides are reset at once."""
        self._call(lambda: self._set_mode(Mode.BLACKHOLE, None))

    def hold(self, predicate: Predicate) -> None:
        """Forward everything except requests whose head matches ``predicate`` (called on the proxy
        thread; an exception counts as no match and is recorded in ``errors``): those are buffered
        whole and kept back, with everything after them on their connection, until
        :meth:`release_held`."""
        self._call(lambda: self._set_mode(Mode.HOLD, predicate))

    @property
    def held(self) -> list[HeldRequest]:
        """The requests held now (not yet released), in the order they were held."""
        with self._cond:
            return list(self._held)

    def wait_held(self, n: int, timeout: float, *, complete: bool = False) -> list[HeldRequest]:
        """Block until at least ``n`` requests are held (with ``complete``: held with their whole
        body arrived, so that the client may die now and the request still be delivered whole);
        those held then. Not on the reactor thread when the client is in this process: use
        :meth:`until_held`."""

        def enough() -> bool:
            held = [h for h in self._held if h._complete] if complete else self._held
            return len(held) >= n

        with self._cond:
            if not self._cond.wait_for(enough, timeout):
                whole = sum(1 for h in self._held if h._complete)
                raise TimeoutError(
                    f"{self!r}: {len(self._held)} of {n} requests held ({whole} whole) after "
                    f"{timeout:g}s"
                )
            return list(self._held)

    async def until_held(self, n: int, within: float = 10.0) -> list[HeldRequest]:
        """:meth:`wait_held` in the reactor's thread pool, for a test running on the reactor."""
        from twisted.internet import reactor
        from twisted.internet.threads import deferToThreadPool

        r: Any = reactor
        result: list[HeldRequest] = await deferToThreadPool(
            r, r.getThreadPool(), self.wait_held, n, within
        )
        return result

    def release_held(self, count: int | None = None) -> list[HeldRequest]:
        """Send the first ``count`` held requests (all when ``None``) upstream, in the order they were
        held, whatever the mode: on their own connection if it still works (the client gets the
        answer), else on a fresh connection whose answer is discarded. A request whose client left
        before its body had arrived whole cannot be sent: it is marked ``abandoned``. Returns the
        released requests (``wait_answered`` tells when each landed)."""
        return self._call(lambda: self._release(count))

    @property
    def requests(self) -> list[Exchange]:
        """Every request head seen, in arrival order, and what became of it."""
        with self._cond:
            return [e.snapshot() for e in self._exchanges]

    def stats(self) -> Stats:
        with self._cond:
            c = self._counts
            return Stats(
                connections=c["connections"],
                open_connections=c["open"],
                upstream_connect_failures=c["upstream_connect_failures"],
                bytes_up=c["bytes_up"],
                bytes_down=c["bytes_down"],
                bytes_dropped=c["bytes_dropped"],
                requests_seen=c["requests_seen"],
                requests_up=c["requests_up"],
                requests_held=c["requests_held"],
                requests_dropped=c["requests_dropped"],
                responses_down=c["responses_down"],
            )

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the proxy thread and return its result (directly when that thread is not
        running: nothing else touches the proxy's state then)."""
        if threading.current_thread() is self._thread:
            return fn()
        with self._command_lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._thread is None:
                return fn()
        done, box = self._submit(fn)
        if not done.wait(_COMMAND_TIMEOUT):
            raise RuntimeError(f"{self!r}: the proxy thread did not run a command")
        if len(box) == 2:
            raise box[1]
        result: T = box[0]
        return result

    def _submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
        done, box = threading.Event(), list[Any]()
        with self._command_lock:
            self._commands.append((fn, done, box))
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._waker_w.send(b"x")
        return done, box

    def _run_commands(self) -> None:
        while True:
            with self._command_lock:
                if not self._commands:
                    return
                fn, done, box = self._commands.popleft()
            try:
                box.append(fn())
            except BaseException as e:
                box.extend([None, e])
            done.set()

    # -- the loop (proxy thread) ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select():
                    try:
                        self._dispatch(key, mask)
                    except Exception:  # (a connection's own failure is handled in _dispatch)
                        self._error("the proxy loop failed")
                    if self._stopping:
                        break
        except BaseException:
            self._error("the proxy loop died")
        finally:
            self._run_commands()  # nobody waits forever on a command the loop never ran
            self._teardown()

    def _stop(self) -> None:
        self._stopping = True

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        sock: Any = key.fileobj
        if sock is self._waker_r:
            with contextlib.suppress(BlockingIOError):
                while self._waker_r.recv(4096):
                    pass
            self._run_commands()
            return
        if sock is self._listener:
            self._accept()
            return
        pipe, side = key.data
        if pipe.closed:
            return
        try:
            if side == "client":
                if mask & selectors.EVENT_WRITE:
                    self._write(pipe, "client")
                if mask & selectors.EVENT_READ and not pipe.closed:
                    self._read_client(pipe)
            else:
                if mask & selectors.EVENT_WRITE:
                    self._write(pipe, "upstream")
                if mask & selectors.EVENT_READ and not pipe.closed:
                    self._read_upstream(pipe)
            self._settle(pipe)
        except Exception:
            self._error(f"connection {pipe.number} failed")
            self._abort(pipe)

    def _error(self, what: str) -> None:
        with self._cond:
            self.errors.append(f"{what}:\n{traceback.format_exc()}")

    def _watch(self, sock: socket.socket | None, events: int, data: Any) -> None:
        if sock is None:
            return
        current = self._interest.get(sock, 0)
        if events == current:
            return
        if not events:
            self._selector.unregister(sock)
            del self._interest[sock]
        elif not current:
            self._selector.register(sock, events, data)
            self._interest[sock] = events
        else:
            self._selector.modify(sock, events, data)
            self._interest[sock] = events

    def _forget(self, sock: socket.socket | None, *, reset: bool) -> None:
        if sock is None:
            return
        if self._interest.pop(sock, 0):
            self._selector.unregister(sock)
        if reset:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
        sock.close()

    def _accept(self) -> None:
        for _ in range(64):  # then let the other sockets have a turn
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                self._error("accept failed")
                return
            self._count("connections")
            if self._mode is Mode.CUT:  # only when the listener could not be paused (not Linux)
                self._forget(sock, reset=True)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe_numbers += 1
            pipe = _Pipe(self._pipe_numbers, sock, poisoned=self._mode is Mode.BLACKHOLE)
            self._pipes.add(pipe)
            self._count("open")
            if not pipe.poisoned:
                self._connect_upstream(pipe)
            self._settle(pipe)

    def _connect_upstream(self, pipe: _Pipe) -> None:
        sock = socket.socket(self._up_family, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(self._up_address)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            self._count("upstream_connect_failures")
            self._abort(pipe)
            return
        pipe.upstream, pipe.connecting = sock, err != 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- reading and writing ----------------------------------------------------------------------

    def _read_client(self, pipe: _Pipe) -> None:
        assert pipe.client is not None
        try:
            data = pipe.client.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(pipe)  # the client reset: so is the upstream (a held request survives)
            return
        if not data:
            pipe.client_eof = True
        else:
            pipe.requests.feed(data)
        self._pump_requests(pipe)

    def _read_upstream(self, pipe: _Pipe) -> None:
        assert pipe.upstream is not None
        try:
            data = pipe.upstream.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(pipe)
            return
        if not data:
            pipe.up_eof = True
            self._detach_held(pipe)  # its answer could not come back this way any more
        else:
            pipe.responses.feed(data)
        self._pump_responses(pipe)

    def _write(self, pipe: _Pipe, side: str) -> None:
        if side == "upstream":
            sock, buf = pipe.upstream, pipe.to_up
            if sock is not None and pipe.connecting:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._count("upstream_connect_failures")
                    self._abort(pipe)  # the client sees a reset at once, as if it were refused
                    return
                pipe.connecting = False
        else:
            sock, buf = pipe.client, pipe.to_client
        if sock is None or not buf:
            return
        try:
            sent = sock.send(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(pipe)
            return
        del buf[:sent]
        self._count("bytes_up" if side == "upstream" else "bytes_down", sent)

    # -- HTTP awareness ---------------------------------------------------------------------------

    def _pump_requests(self, pipe: _Pipe) -> None:
        stream = pipe.requests
        while not (pipe.holding is not None and pipe.holding._complete):
            event = stream.pull()
            if event is None:
                break
            kind, data = event
            if kind is _Event.HEAD:
                self._request_head(pipe, data)
                continue
            self._send_up(pipe, data)  # (an END may carry the blank line ending the trailers)
            if kind is _Event.END and pipe.holding is not None:
                with self._cond:
                    pipe.holding._complete = True
                    self._cond.notify_all()
        if pipe.client_eof and pipe.holding is None and stream.buffer:
            self._send_up(pipe, stream.drain())  # a partial head at the end: passed on as it is

    def _request_head(self, pipe: _Pipe, head: bytes) -> None:
        parsed = _parse_head(head, _REQUEST_LINE)
        if parsed is None:
            pipe.requests.set_framing(_Framing.OPAQUE)
            self._send_up(pipe, head)
            return
        start, headers = parsed
        method = start.group(1).decode("ascii")
        target = start.group(2).decode("latin-1")
        framing, length = _body_framing(headers, request=True)
        if method == "CONNECT" or "upgrade" in headers.get("connection", "").lower():
            framing = _Framing.OPAQUE  # a tunnel or another protocol follows this head
        pipe.requests.set_framing(framing, length)
        hold = False
        if not pipe.poisoned and self._mode is Mode.HOLD and self._predicate is not None:
            try:
                hold = bool(self._predicate(method, target, dict(headers)))
            except Exception:
                self._error(f"the hold predicate failed on {method} {target}")
        exchange = _Exchange(method, target, held=hold, dropped=pipe.poisoned)
        with self._cond:
            self._exchanges.append(exchange)
            self._counts["requests_seen"] += 1
            if pipe.poisoned:
                self._counts["requests_dropped"] += 1
        if hold:
            held = HeldRequest(self, exchange, headers)
            held._pipe = pipe
            held._data += head
            pipe.holding = held
            with self._cond:
                self._held.append(held)
                self._counts["requests_held"] += 1
                self._cond.notify_all()
            return
        if not pipe.poisoned:
            pipe.awaiting.append(exchange)
            self._count("requests_up")
        self._send_up(pipe, head)

    def _send_up(self, pipe: _Pipe, data: bytes) -> None:
        if pipe.holding is not None:
            pipe.holding._data += data
        elif pipe.poisoned or pipe.upstream is None:
            self._count("bytes_dropped", len(data))
        else:
            pipe.to_up += data

    def _pump_responses(self, pipe: _Pipe) -> None:
        stream = pipe.responses
        while True:
            event = stream.pull()
            if event is None:
                break
            kind, data = event
            if kind is _Event.HEAD:
                self._response_head(pipe, data)
            elif pipe.failing is not None:
                with self._cond:
                    kept = pipe.failing.error_body
                    kept += data[: max(0, _ERROR_BODY_KEPT - len(kept))]
                if kind is _Event.END:
                    pipe.failing = None
            self._send_down(pipe, data)
        if pipe.up_eof and stream.buffer:
            self._send_down(pipe, stream.drain())

    def _response_head(self, pipe: _Pipe, head: bytes) -> None:
        parsed = _parse_head(head, _STATUS_LINE)
        if parsed is None or not pipe.awaiting:  # garbage, or an answer to nothing we sent
            pipe.responses.set_framing(_Framing.OPAQUE)
            return
        start, headers = parsed
        status = int(start.group(1))
        if 100 <= status < 200 and status != 101:  # 100 Continue and the like: a final one follows
            pipe.responses.set_framing(_Framing.LENGTH, 0)
            return
        exchange = pipe.awaiting.popleft()
        pipe.failing = exchange if status >= 400 else None
        with self._cond:
            exchange.status, exchange.answered = status, time.monotonic()
            self._counts["responses_down"] += 1
            self._cond.notify_all()
        if status == 101:
            pipe.responses.set_framing(_Framing.OPAQUE)
        elif exchange.method == "HEAD" or status in (204, 304):
            pipe.responses.set_framing(_Framing.LENGTH, 0)
        else:
            pipe.responses.set_framing(*_body_framing(headers, request=False))

    def _send_down(self, pipe: _Pipe, data: bytes) -> None:
        if pipe.client is None or pipe.poisoned or pipe.closed:
            self._count("bytes_dropped", len(data))
        else:
            pipe.to_client += data

    # -- connection state -------------------------------------------------------------------------

    def _settle(self, pipe: _Pipe) -> None:
        """After any change: pass half-closes on, close what is finished, watch what is left."""
        if pipe.closed:
            return
        if pipe.client is None:  # a delivery of released requests
            if pipe.up_eof or (
                not pipe.connecting
                and not pipe.to_up
                and not pipe.awaiting
                and pipe.responses.between_messages
            ):
                self._close(pipe, reset=False)
                return
        if (
            pipe.client_eof
            and pipe.holding is None
            and not pipe.poisoned
            and pipe.upstream is not None
            and not pipe.connecting
            and not pipe.to_up
            and not pipe.up_shut
        ):
            with contextlib.suppress(OSError):
                pipe.upstream.shutdown(socket.SHUT_WR)
            pipe.up_shut = True
        if pipe.up_eof and pipe.client is not None and not pipe.to_client and not pipe.client_shut:
            with contextlib.suppress(OSError):
                pipe.client.shutdown(socket.SHUT_WR)
            pipe.client_shut = True
        if pipe.client is not None and not pipe.poisoned and pipe.client_eof and pipe.up_eof:
            if pipe.up_shut and pipe.client_shut:
                self._close(pipe, reset=False)
                return
        # A blackholed client's FIN gets nothing back, not even a FIN: its socket waits for the
        # heal (a reset) or close().
        self._watch_pipe(pipe)

    def _watch_pipe(self, pipe: _Pipe) -> None:
        if pipe.client is not None:
            events = 0
            blocked = pipe.holding is not None and pipe.holding._complete
            if not pipe.client_eof and (
                pipe.poisoned
                or (
                    len(pipe.to_up) < _HIGH_WATER
                    and not (blocked and len(pipe.requests.buffer) >= _HIGH_WATER)
                )
            ):
                events |= selectors.EVENT_READ
            if pipe.to_client:
                events |= selectors.EVENT_WRITE
            self._watch(pipe.client, events, (pipe, "client"))
        if pipe.upstream is not None:
            if pipe.connecting:
                events = selectors.EVENT_WRITE
            else:
                events = 0
                if not pipe.up_eof and len(pipe.to_client) < _HIGH_WATER:
                    events |= selectors.EVENT_READ
                if pipe.to_up:
                    events |= selectors.EVENT_WRITE
            self._watch(pipe.upstream, events, (pipe, "upstream"))

    def _detach_held(self, pipe: _Pipe) -> None:
        """The pipe can no longer carry its held request: it will go on a fresh connection."""
        if pipe.holding is not None:
            pipe.holding._pipe = None
            pipe.holding = None

    def _lose(self, pipe: _Pipe) -> None:
        """The requests the pipe forwarded will get no answer through it."""
        with self._cond:
            for exchange in pipe.awaiting:
                exchange.lost = True
            self._cond.notify_all()
        pipe.awaiting.clear()

    def _close(self, pipe: _Pipe, *, reset: bool) -> None:
        if pipe.closed:
            return
        self._detach_held(pipe)
        self._lose(pipe)
        pipe.closed = True
        self._pipes.discard(pipe)
        self._count("open", -1)
        self._forget(pipe.client, reset=reset)
        self._forget(pipe.upstream, reset=reset)

    def _abort(self, pipe: _Pipe) -> None:
        """Reset both sides at once (an error on one side, a cut)."""
        self._close(pipe, reset=True)

    def _poison(self, pipe: _Pipe) -> None:
        """Blackhole an open connection: its upstream side is reset, its client side swallowed."""
        self._detach_held(pipe)
        pipe.poisoned = True
        self._forget(pipe.upstream, reset=True)
        pipe.upstream, pipe.connecting = None, False
        self._count("bytes_dropped", len(pipe.to_up) + len(pipe.to_client))
        pipe.to_up.clear()
        pipe.to_client.clear()
        self._lose(pipe)
        self._pump_requests(pipe)  # bytes waiting behind a held request are swallowed now
        self._settle(pipe)

    # -- commands (proxy thread) ------------------------------------------------------------------

    def _set_mode(self, mode: Mode, predicate: Predicate | None) -> None:
        old = self._mode
        self._mode, self._predicate = mode, predicate
        clients = [p for p in self._pipes if p.client is not None]
        if mode is Mode.CUT:
            self._pause_listener()
            for pipe in clients:
                self._abort(pipe)
            return
        self._resume_listener()
        if mode is Mode.BLACKHOLE:
            for pipe in clients:
                if not pipe.poisoned:
                    self._poison(pipe)
        elif old is Mode.BLACKHOLE:
            for pipe in clients:
                if pipe.poisoned:
                    self._abort(pipe)

    def _pause_listener(self) -> None:
        # Keep accepting, and _accept resets each connection while cut. (Shutting the listener
        # down would refuse connections outright, but its port is then free for the kernel to
        # hand to an outgoing connection, and listen() at the heal fails with EADDRINUSE: seen
        # with a router's own S3 connections on a loaded machine.)
        return

    def _resume_listener(self) -> None:
        if self._listening:
            return
        self._listener.listen(_BACKLOG)
        self._watch(self._listener, selectors.EVENT_READ, None)
        self._listening = True

    def _release(self, count: int | None) -> list[HeldRequest]:
        with self._cond:
            chosen = self._held[: len(self._held) if count is None else count]
            del self._held[: len(chosen)]
            now = time.monotonic()
            for held in chosen:
                held._released_at = now
        for held in chosen:
            pipe = held._pipe
            if pipe is not None and pipe.usable and pipe.holding is held:
                pipe.holding, held._pipe = None, None
                pipe.to_up += held._data
                pipe.awaiting.append(held._exchange)
                self._count("requests_up")
                self._pump_requests(pipe)  # what waited behind it, and the rest of its body
                self._settle(pipe)
                continue
            if pipe is not None:
                self._detach_held(pipe)
                self._pump_requests(pipe)
                self._settle(pipe)
            if not held._complete:
                with self._cond:
                    held._abandoned = True
                    self._cond.notify_all()
                continue
            self._deliver(held)
        return chosen

    def _deliver(self, held: HeldRequest) -> None:
        """Send a released request on a connection of its own; its answer is read and discarded."""
        self._pipe_numbers += 1
        pipe = _Pipe(self._pipe_numbers, None, poisoned=False)
        self._pipes.add(pipe)
        self._count("open")
        pipe.to_up += held._data
        pipe.awaiting.append(held._exchange)
        self._count("requests_up")
        self._connect_upstream(pipe)
        self._settle(pipe)

    def _teardown(self) -> None:
        """Close everything (on the proxy thread as it ends, or in close() if it never ran)."""
        if self._torn_down:
            return
        self._torn_down = True
        for pipe in list(self._pipes):
            self._abort(pipe)
        with self._cond:
            self._held.clear()
            self._cond.notify_all()
        for sock in (self._listener, self._waker_r, self._waker_w):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        self._interest.clear()
        self._selector.close()

"""Helpers for the adversarial proxy tests (tests/test_proxy_adversarial.py).

* :class:`RecordingBackend`: a real unix-socket backend that keeps every raw byte it receives, per
  connection, re-parses them with httptools and answers each request with a fixed response.
* :func:`backend_problems`: what must never be true of the bytes a backend received (ambiguous
  framing, internal or hop-by-hop headers, bytes that do not parse as HTTP/1.1 requests).
* :class:`BodyBackend`: the same, answering with a body of a given size written as fast as the
  proxy takes it (a space serving a large file).
* :class:`RawClient` / :func:`exchange`: a Twisted client that sends exactly the bytes we say.
* ``python -m tests.proxy_harness DIR``: the proxy plus a recording backend in a process of their own,
  for the hypothesis test to drive with blocking sockets (see :func:`main`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Any, Literal, cast

import httptools
from attrs import define, field
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from lchat import tls
from lchat.config import ProxyConfig
from lchat.proxy.serve import FrontPort, bind
from lchat.proxy.upstream import UpstreamConnection, UpstreamPool
from lchat.registry import Route, RouteTable
from lchat.router import LocalResponse, RemotePeer, RequestHead, Router, Target

Header = tuple[bytes, bytes]

KNOWN = "chat.example.com"
# Names that must never reach a space (compared lowercased; the underscore spellings CGI/WSGI-style
# servers fold into the same HTTP_* variable are a separate, expected-failure test).
INTERNAL_NAMES = frozenset({"x-lchat-sidecar", "x-lchat-mesh-forwarded"})
HOP_BY_HOP_NAMES = frozenset(
    {"keep-alive", "te", "trailer", "proxy-connection", "proxy-authorization", "proxy-authenticate"}
)
RESPONSE_BODY = b"ok\n"


def norm_name(name: bytes) -> str:
    return name.decode("latin-1").strip().lower()


# --- re-parsing what a backend received ---------------------------------------------------------


@define
class Message:
    method: bytes = b""
    target: bytes = b""
    version: str = ""
    headers: list[Header] = field(factory=list)
    trailers: list[Header] = field(factory=list)
    body: bytes = b""
    head_complete: bool = False
    complete: bool = False

    def values(self, name: str) -> list[bytes]:
        return [v for n, v in self.headers if norm_name(n) == name]


@define
class Parsed:
    messages: list[Message] = field(factory=list)
    error: str | None = None
    upgraded: bool = False  # the stream switched protocols after the last message

    @property
    def complete(self) -> list[Message]:
        return [m for m in self.messages if m.complete]


class _RequestCollector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.parser: httptools.HttpRequestParser | None = None
        self._body: list[bytes] = []

    @property
    def current(self) -> Message:
        return self.messages[-1]

    def on_message_begin(self) -> None:
        self.messages.append(Message())
        self._body = []

    def on_url(self, url: bytes) -> None:
        self.current.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.current.head_complete:
            self.current.trailers.append((name, value))
        else:
            self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        msg = self.current
        msg.head_complete = True
        msg.method = self.parser.get_method()
        msg.version = self.parser.get_http_version()

    def on_body(self, data: bytes) -> None:
        self._body.append(data)
        self.current.body = b"".join(self._body)

    def on_message_complete(self) -> None:
        self.current.complete = True


def parse_requests(data: bytes) -> Parsed:
    """Split ``data`` into HTTP/1.1 requests the way a strict (llhttp) server would."""
    collector = _RequestCollector()
    parser = httptools.HttpRequestParser(collector)
    collector.parser = parser
    result = Parsed()
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        result.upgraded = True
    except httptools.HttpParserError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.messages = collector.messages
    return result


def backend_problems(
    data: bytes, *, allow_truncated_last: bool = True, first: int = 0
) -> list[str]:
    """Everything wrong with the bytes one backend connection received (empty when all is well).

    Each request must be well-formed HTTP/1.1 with exactly one framing: never both Content-Length and
    Transfer-Encoding, a Transfer-Encoding that is exactly ``chunked`` (ours), no trailers, exactly one
    Host, no internal or hop-by-hop headers. Only the last request may be cut short (the proxy aborts
    an upstream connection when the client goes away mid-body). Requests before ``first`` (already
    checked) are skipped, and so is a parse error found among them.
    """
    problems: list[str] = []
    parsed = parse_requests(data)
    if parsed.error is not None and len(parsed.messages) > first:
        problems.append(f"backend stream does not parse: {parsed.error}")
    for i, msg in enumerate(parsed.messages):
        if i < first:
            continue
        where = f"request {i} ({msg.method!r} {msg.target[:60]!r})"
        last = i == len(parsed.messages) - 1
        if not msg.complete and not (last and allow_truncated_last):
            problems.append(f"{where} is incomplete but followed by more bytes")
        if not msg.head_complete:
            if last and allow_truncated_last:
                problems.append(f"{where}: the proxy wrote a partial head")
            continue
        if msg.version != "1.1":
            problems.append(f"{where}: forwarded as HTTP/{msg.version}")
        lengths = msg.values("content-length")
        encodings = msg.values("transfer-encoding")
        if lengths and encodings:
            problems.append(f"{where}: both Content-Length and Transfer-Encoding")
        if len(lengths) > 1:
            problems.append(f"{where}: {len(lengths)} Content-Length headers")
        if encodings and encodings != [b"chunked"]:
            problems.append(f"{where}: Transfer-Encoding {encodings!r} is not ours")
        if msg.trailers:
            problems.append(f"{where}: trailers forwarded {msg.trailers!r}")
        hosts = msg.values("host")
        if len(hosts) != 1:
            problems.append(f"{where}: {len(hosts)} Host headers")
        for name, value in msg.headers:
            lower = norm_name(name)
            if lower in INTERNAL_NAMES:
                problems.append(f"{where}: internal header {name!r}: {value!r} reached the backend")
            if lower in HOP_BY_HOP_NAMES:
                problems.append(f"{where}: hop-by-hop header {name!r} reached the backend")
        if not msg.target.startswith(b"/") and msg.target != b"*":
            problems.append(f"{where}: target is not origin-form")
    return problems


# --- parsing what a client received -------------------------------------------------------------

STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [^\r\n]*\r\n")


@define
class Reply:
    """What a raw client got back: the bytes, whether the proxy closed, and how long it took."""

    data: bytes
    closed: bool
    elapsed: float

    @property
    def status(self) -> int | None:
        m = STATUS_LINE.match(self.data)
        return int(m.group(1)) if m else None

    def statuses(self) -> list[int]:
        return [int(s) for s in re.findall(rb"(?:^|\n)HTTP/1\.1 ([0-9]{3}) ", self.data)]

    def header(self, name: bytes) -> bytes | None:
        head = self.data.split(b"\r\n\r\n", 1)[0]
        for line in head.split(b"\r\n")[1:]:
            n, _, v = line.partition(b":")
            if n.strip().lower() == name.lower():
                return v.strip()
        return None


class _ResponseCollector:
    def __init__(self) -> None:
        self.done = 0

    def on_message_complete(self) -> None:
        self.done += 1


class _StatusCollector:
    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.statuses: list[int] = []

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.statuses.append(self.parser.get_status_code())


def response_statuses(data: bytes) -> list[int]:
    """The status of each complete response in ``data`` (replies to requests other than HEAD)."""
    collector = _StatusCollector()
    collector.parser = httptools.HttpResponseParser(collector)
    try:
        collector.parser.feed_data(data)
    except httptools.HttpParserError:
        pass
    return collector.statuses


def complete_responses(data: bytes) -> int:
    """How many complete responses ``data`` holds (for replies to requests other than HEAD)."""
    collector = _ResponseCollector()
    parser = httptools.HttpResponseParser(collector)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        pass
    return collector.done


# --- the recording backend ----------------------------------------------------------------------

Mode = Literal["complete", "head", "silent"]


class BackendConnection(Protocol):
    """One connection to the recording backend."""

    def __init__(self, backend: RecordingBackend, number: int) -> None:
        self.backend = backend
        self.number = number
        self.raw = bytearray()
        self.lost: Deferred[None] = Deferred()
        self.is_lost = False
        self.collector = _RequestCollector()
        self.parser = httptools.HttpRequestParser(self)
        self.collector.parser = self.parser
        self.answered = 0
        self.error: str | None = None
        self.sink: Any = None

    # parser callbacks: record with the collector, answer per the backend's mode
    def on_message_begin(self) -> None:
        self.collector.on_message_begin()

    def on_url(self, url: bytes) -> None:
        self.collector.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.collector.on_header(name, value)

    def on_headers_complete(self) -> None:
        self.collector.on_headers_complete()
        if self.backend.mode == "head":
            self._answer()

    def on_body(self, data: bytes) -> None:
        self.collector.on_body(data)

    def on_message_complete(self) -> None:
        self.collector.on_message_complete()
        if self.backend.mode == "complete":
            self._answer()

    def _answer(self) -> None:
        assert self.transport is not None
        msg = self.collector.current
        body = b"" if msg.method == b"HEAD" else RESPONSE_BODY
        self.answered += 1
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Backend-Conn: %d\r\n"
            b"X-Lchat-Sidecar: from-backend\r\n\r\n%s" % (len(RESPONSE_BODY), self.number, body)
        )

    # protocol
    def connectionMade(self) -> None:
        self.backend.connections.append(self)
        if self.backend.sink_dir is not None:
            path = os.path.join(self.backend.sink_dir, f"conn-{self.number:05d}.bin")
            self.sink = open(path, "ab", buffering=0)  # closed in connectionLost

    def dataReceived(self, data: bytes) -> None:
        self.raw += data
        if self.sink is not None:
            self.sink.write(data)
        if self.error is not None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error = "upgrade"  # we never switch: the rest is not HTTP
        except httptools.HttpParserError as e:
            self.error = f"{type(e).__name__}: {e}"
            assert self.transport is not None
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.is_lost = True
        if self.sink is not None:
            self.sink.close()
            self.sink = None
        self.lost.callback(None)


class RecordingBackend(Factory):
    """Records every byte per connection. ``mode``: answer each request when it is complete, as soon
    as its head is parsed, or never."""

    noisy = False

    def __init__(self, mode: Mode = "complete", sink_dir: str | None = None) -> None:
        self.mode = mode
        self.sink_dir = sink_dir
        self.connections: list[BackendConnection] = []
        self._count = 0

    def buildProtocol(self, addr: Any) -> BackendConnection:
        self._count += 1
        return BackendConnection(self, self._count)

    @property
    def received(self) -> bytes:
        return b"".join(bytes(c.raw) for c in self.connections)

    def requests(self) -> list[Message]:
        return [m for c in self.connections for m in parse_requests(bytes(c.raw)).messages]

    def problems(self) -> list[str]:
        out: list[str] = []
        for c in self.connections:
            out += [f"backend connection {c.number}: {p}" for p in backend_problems(bytes(c.raw))]
        return out


@implementer(IPushProducer)
class _BodyPump:
    """Writes ``size`` bytes to ``transport`` while it is not paused (the backend's backpressure)."""

    PIECE = b"b" * 65536

    def __init__(self, transport: Any, size: int) -> None:
        from twisted.internet import reactor

        self._reactor: Any = reactor
        self._transport = transport
        self._left = size
        self._paused = False
        transport.registerProducer(self, True)
        self._reactor.callLater(0, self._pump)

    def _pump(self) -> None:
        while not self._paused and self._left > 0:
            piece = self.PIECE[: min(len(self.PIECE), self._left)]
            self._left -= len(piece)
            self._transport.write(piece)
        if self._left <= 0 and self._transport is not None:
            self._transport.unregisterProducer()
            self._transport = None

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        if self._paused:
            self._paused = False
            self._reactor.callLater(0, self._pump)

    def stopProducing(self) -> None:
        self._left = 0
        self._paused = True


class BodyConnection(BackendConnection):
    backend: BodyBackend

    def _answer(self) -> None:
        assert self.transport is not None
        msg = self.collector.current
        self.answered += 1
        size = self.backend.size
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        if size and msg.method != b"HEAD":
            _BodyPump(self.transport, size)


class BodyBackend(RecordingBackend):
    """A recording backend whose answer to each complete request has a ``size``-byte body."""

    def __init__(self, size: int) -> None:
        super().__init__("complete")
        self.size = size

    def buildProtocol(self, addr: Any) -> BackendConnection:
        self._count += 1
        return BodyConnection(self, self._count)


# --- a raw client (in-process, Twisted) ---------------------------------------------------------


class RawClient(Protocol):
    """Sends exactly the bytes it is told; keeps everything it receives and when it was closed."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.is_closed = False
        self.closed_at = 0.0

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.is_closed = True
        self.closed_at = time.monotonic()

    def abort(self) -> None:
        if not self.is_closed and self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]


class RawClientFactory(Factory):
    noisy = False

    def buildProtocol(self, addr: Any) -> RawClient:
        return RawClient()


# --- the proxy in a process of its own (for hypothesis) -----------------------------------------


class FuzzRouter:
    """The real Router, plus ``stats.example.com`` answering with the proxy's leak counters."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.factory: Any = None

    def route(self, head: RequestHead) -> Target | Deferred[Target]:
        if head.host == "stats.example.com":
            return LocalResponse(200, json.dumps(proxy_stats(self.factory)).encode())
        return self.router.route(head)

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        raise AssertionError("no mesh peer is routed to here")


@define
class _Table:
    table: RouteTable


def route_table(rows: Iterable[tuple[str, str]]) -> _Table:
    routes = {h: Route(host=h, kind="instance", socket=p, status="ready") for h, p in rows}
    return _Table(RouteTable(routes=MappingProxyType(routes)))


def proxy_stats(factory: Any) -> dict[str, float]:
    pool = factory.pool
    idle = sum(len(v) for v in pool._idle.values())
    return {
        "in_flight": float(factory.state.stats.in_flight),
        "connections": float(factory.state.stats.connections),
        "upstream_total": float(len(pool._connections)),
        "upstream_idle": float(idle),
    }


FUZZ_CONFIG = ProxyConfig(
    header_timeout=0.3,
    keepalive_timeout=0.6,
    upstream_timeout=1.0,
    dial_retry=0.3,
    max_header_bytes=4096,
    max_headers=24,
)


def idle_connections(pool: UpstreamPool) -> list[UpstreamConnection]:
    """Every idle connection ``pool`` keeps."""
    return [conn for idle in pool._idle.values() for conn in idle]


def listen_now(
    factory: Any,
    address: str = "tcp:0:interface=127.0.0.1",
    store: tls.CertStore | None = None,
    **options: Any,
) -> FrontPort:
    """Bind ``address`` and serve ``factory`` on it (TLS with ``store``; ``options``: ``loop``,
    and :class:`FrontPort`'s). The socket listens on return; connections are accepted from the
    loop's next turn on."""
    port = _bound(factory, address, store, options)
    port.start().addErrback(lambda f: Logger().failure("serving {a} failed", f, a=address))
    return port


def listen(
    factory: Any,
    address: str = "tcp:0:interface=127.0.0.1",
    store: tls.CertStore | None = None,
    **options: Any,
) -> Deferred[FrontPort]:
    """:func:`listen_now`, firing once the port serves."""
    port = _bound(factory, address, store, options)
    return port.start().addCallback(lambda _: port)


def _bound(
    factory: Any, address: str, store: tls.CertStore | None, options: dict[str, Any]
) -> FrontPort:
    loop = options.pop("loop", None) or asyncio.get_event_loop()
    return FrontPort(loop, bind(address), factory, store, **options)


def main(argv: Sequence[str]) -> None:
    """``python -m tests.proxy_harness DIR``: serve the proxy on 127.0.0.1 with a recording backend
    (answering on head) for ``chat.example.com``; print ``{"port": N}``; record each backend
    connection's bytes in ``DIR/conn-*.bin`` and every logged error in ``DIR/errors.log``."""
    from lchat import uvloop_reactor

    uvloop_reactor.install()  # as the router runs

    from twisted.internet import reactor as _reactor
    from twisted.internet.endpoints import UNIXServerEndpoint
    from twisted.logger import ILogObserver, globalLogBeginner

    from lchat.proxy.downstream import ProxyFactory

    reactor: Any = _reactor
    directory = argv[0]
    errors = open(os.path.join(directory, "errors.log"), "a", buffering=1)

    def observer(event: dict[str, Any]) -> None:
        if event.get("log_failure") is not None or event.get("isError"):
            from twisted.logger import formatEvent

            failure = event.get("log_failure")
            errors.write(formatEvent(event) + "\n")
            if failure is not None:
                errors.write(failure.getTraceback() + "\n")

    globalLogBeginner.beginLoggingTo([cast(ILogObserver, observer)], redirectStandardIO=False)
    sock = os.path.join(directory, "backend.sock")
    backend = RecordingBackend("head", sink_dir=directory)

    def started(port: Any) -> None:
        print(json.dumps({"port": port.getHost().port}), flush=True)

    def serve(_: Any) -> Deferred[Any]:
        return listen(factory).addCallback(started)

    router = FuzzRouter(Router(route_table([(KNOWN, sock)])))
    factory = ProxyFactory(reactor, router, FUZZ_CONFIG)
    router.factory = factory
    UNIXServerEndpoint(reactor, sock).listen(backend).addCallback(serve)
    reactor.run()


def blocking_exchange(
    port: int, data: bytes | Sequence[bytes], *, deadline: float, quiet: float = 0.08
) -> tuple[bytes, bool, float]:
    """Send ``data`` (pieces a few milliseconds apart, so they arrive as separate reads); read until
    the proxy closes, or ``quiet`` seconds pass with nothing new once something came back, or
    ``deadline`` seconds. Returns (bytes, closed by the proxy, elapsed)."""
    start = time.monotonic()
    received = bytearray()
    pieces = [data] if isinstance(data, bytes) else list(data)
    with socket.create_connection(("127.0.0.1", port), timeout=deadline) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i, piece in enumerate(pieces):
                if i:
                    time.sleep(0.005)
                s.sendall(piece)
        except OSError:
            pass  # the proxy may close before reading everything: what it sent back still counts
        while True:
            now = time.monotonic()
            left = deadline - (now - start)
            if left <= 0:
                return bytes(received), False, now - start
            # once something came back, a quiet spell ends the wait (a HEAD answer never
            # "completes" for a parser that does not know it was HEAD)
            wait = min(left, quiet) if received else left
            s.settimeout(wait)
            try:
                piece = s.recv(65536)
            except TimeoutError:
                if received:
                    return bytes(received), False, time.monotonic() - start
                continue
            except ConnectionResetError:
                return bytes(received), True, time.monotonic() - start
            if not piece:
                return bytes(received), True, time.monotonic() - start
            received += piece


if __name__ == "__main__":
    main(sys.argv[1:])

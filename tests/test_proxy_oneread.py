"""lchat.proxy.oneread: the one-read recognisers, held to the general path.

The invariant (oneread's docstring): what the recognisers accept is a strict subset of what the
general path accepts, and for it the proxy does exactly what the general path does. Each test here
drives the real Downstream and UpstreamConnection in memory (recording transports, a fake clock),
once as shipped and once with the recognisers switched off, and compares everything observable:
the bytes the space receives (as parsed), the bytes the client receives (exactly), the deadline
left armed, the metrics. Generated inputs cover the edges (hypothesis); explicit ones prove that
the fast path is actually taken where it should be, so that the comparison is not vacuous.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any
from unittest.mock import patch

import httptools
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from lchat.config import ProxyConfig
from lchat.proxy import downstream, http, oneread
from lchat.proxy.downstream import Downstream, ProxyFactory
from lchat.proxy.state import FrontDoorState
from lchat.proxy.upstream import UpstreamConnection, UpstreamPool, target_key
from lchat.router import LocalSocket, RemotePeer, RequestHead, Target, plain
from tests.proxy_harness import idle_connections
from tests.test_proxy import Backend, BackendFactory, ProxyTestCase

KNOWN = "chat.example.com"
SOCKET = "/nonexistent/rig.sock"
WRK = b"GET / HTTP/1.1\r\nHost: chat.example.com\r\n\r\n"
BROWSER = (
    b"GET /api/messages?after=12 HTTP/1.1\r\nHost: chat.example.com\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) Chrome/120\r\nAccept: */*\r\n"
    b"Cookie: _ga=GA1.2; session=ab_cd\r\nConnection: keep-alive\r\n"
    b"Sec-Fetch-Mode: cors\r\n\r\n"
)
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n"

# --- heads as real servers send them ------------------------------------------------------------
# Each the whole answer "ok\n" to WRK on a kept-alive HTTP/1.1 connection, in one read.
#
# nginx 1.22.1 (/usr/sbin/nginx), captured over loopback on 2026-12-05 (the bytes of one recv
# after sending WRK on a socket) from:
#   daemon off; worker_processes 1; events {} http { access_log off; default_type text/plain;
#   server { listen 127.0.0.1:18931; location / { return 200 "ok\n"; } } }
NGINX = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Sat, 05 Dec 2026 15:37:49 GMT\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n"
)
# Node v20.20.2's http (/usr/bin/node), captured likewise from
#   http.createServer((req, res) => { res.writeHead(200, {'Content-Type': 'text/plain',
#   'Content-Length': 3}); res.end('ok\n'); })
NODE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
    b"Date: Sat, 05 Dec 2026 15:37:50 GMT\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n"
    b"\r\nok\n"
)
# ... and from http.createServer((req, res) => { res.end('ok\n'); }) (Node frames it itself).
NODE_BARE = (
    b"HTTP/1.1 200 OK\r\nDate: Sat, 05 Dec 2026 15:38:46 GMT\r\nConnection: keep-alive\r\n"
    b"Keep-Alive: timeout=5\r\nContent-Length: 3\r\n\r\nok\n"
)
# Go's net/http (Go is not installed here: typed from its documented output, net/http's
# extraHeader.Write: Date, Content-Length, the sniffed Content-Type; no Connection header on a
# kept-alive HTTP/1.1 answer) for w.Write([]byte("ok\n")).
GO = (
    b"HTTP/1.1 200 OK\r\nDate: Sat, 05 Dec 2026 15:37:50 GMT\r\nContent-Length: 3\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n\r\nok\n"
)
# Apache httpd 2.4 with mod_http2 offering h2c (not installed here: typed from its documented
# output): the other hop-by-hop lines a server sends on an ordinary answer.
APACHE = (
    b"HTTP/1.1 200 OK\r\nDate: Sat, 05 Dec 2026 15:37:50 GMT\r\nServer: Apache/2.4.62 (Debian)\r\n"
    b"Upgrade: h2,h2c\r\nConnection: Upgrade, Keep-Alive\r\n"
    b'Last-Modified: Sat, 05 Dec 2026 15:00:00 GMT\r\nETag: "3-5f1c"\r\nAccept-Ranges: bytes\r\n'
    b"Content-Length: 3\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: text/plain\r\n\r\nok\n"
)


# Requests as browsers send them over HTTP/1.1 (typed from their developer tools' raw request
# headers: Chrome 131 and Firefox 133 on Linux, a navigation with a session's cookies).
CHROME = (
    b"GET /room/general HTTP/1.1\r\nHost: chat.example.com\r\nConnection: keep-alive\r\n"
    b'sec-ch-ua: "Google Chrome";v="131", "Chromium";v="131", "Not_A Brand";v="24"\r\n'
    b'sec-ch-ua-mobile: ?0\r\nsec-ch-ua-platform: "Linux"\r\nUpgrade-Insecure-Requests: 1\r\n'
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    b"Chrome/131.0.0.0 Safari/537.36\r\n"
    b"Accept: text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,"
    b"image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7\r\n"
    b"Sec-Fetch-Site: same-origin\r\nSec-Fetch-Mode: navigate\r\nSec-Fetch-User: ?1\r\n"
    b"Sec-Fetch-Dest: document\r\nReferer: https://chat.example.com/\r\n"
    b"Accept-Encoding: gzip, deflate, br, zstd\r\nAccept-Language: en-GB,en-US;q=0.9,en;q=0.8\r\n"
    b"Cookie: _ga=GA1.1.1234567890.1733400000; lchat_session=eyJhbGciOiJIUzI1NiJ9.e30.sig; "
    b"theme=dark\r\n\r\n"
)
FIREFOX = (
    b"GET /room/general HTTP/1.1\r\nHost: chat.example.com\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:133.0) Gecko/20100101 Firefox/133.0\r\n"
    b"Accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8\r\n"
    b"Accept-Language: en-GB,en;q=0.5\r\nAccept-Encoding: gzip, deflate, br, zstd\r\n"
    b"Referer: https://chat.example.com/\r\nConnection: keep-alive\r\n"
    b"Cookie: _ga=GA1.1.1234567890.1733400000; lchat_session=eyJhbGciOiJIUzI1NiJ9.e30.sig\r\n"
    b"Upgrade-Insecure-Requests: 1\r\nSec-Fetch-Dest: document\r\nSec-Fetch-Mode: navigate\r\n"
    b"Sec-Fetch-Site: same-origin\r\nSec-Fetch-User: ?1\r\nDNT: 1\r\nSec-GPC: 1\r\n"
    b"Priority: u=0, i\r\n\r\n"
)
BROWSERS = {
    "chrome": CHROME,
    "firefox": FIREFOX,
    # (Firefox adds TE: trailers to requests it sends through a proxy; the general path drops it.)
    "firefox, TE": FIREFOX.replace(
        b"Priority: u=0, i\r\n", b"Priority: u=0, i\r\nTE: trailers\r\n"
    ),
}


def twisted_web_answer() -> bytes:
    """Twisted's web server's answer, made live by twisted.web.server.Site on a memory transport
    (its own bytes, whichever Twisted is installed)."""
    from twisted.internet.testing import StringTransport
    from twisted.web import resource, server

    class Ok(resource.Resource):
        isLeaf = True

        def render_GET(self, request: server.Request) -> bytes:
            request.setHeader(b"content-type", b"text/plain")
            return b"ok\n"

    channel = server.Site(Ok(), reactor=Clock()).buildProtocol(None)
    assert channel is not None
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(WRK)
    channel.connectionLost(None)
    return bytes(transport.value())


def uvicorn_h11_answer() -> bytes:
    """uvicorn's answer on h11, made live by h11 (uvicorn is not installed: the headers it adds,
    date and server, as its h11 protocol adds them, before the application's)."""
    import h11

    connection = h11.Connection(h11.SERVER)
    connection.receive_data(WRK)
    assert isinstance(connection.next_event(), h11.Request)
    headers = [
        (b"date", b"Sat, 05 Dec 2026 15:37:50 GMT"),
        (b"server", b"uvicorn"),
        (b"content-type", b"text/plain"),
        (b"content-length", b"3"),
    ]
    out = connection.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
    return (out or b"") + (connection.send(h11.Data(data=b"ok\n")) or b"")


def real_heads() -> dict[str, tuple[bytes, bytes]]:
    """Each server's answer, and what the client gets for it: the same bytes with the
    hop-by-hop lines taken out (the general path's splice), every other byte as it came."""
    heads = {
        "nginx": (NGINX, NGINX.replace(b"Connection: keep-alive\r\n", b"")),
        "node": (NODE, NODE.replace(b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n", b"")),
        "node bare": (
            NODE_BARE,
            NODE_BARE.replace(b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n", b""),
        ),
        "go": (GO, GO),
        "apache": (
            APACHE,
            APACHE.replace(b"Upgrade: h2,h2c\r\nConnection: Upgrade, Keep-Alive\r\n", b"").replace(
                b"Keep-Alive: timeout=5, max=100\r\n", b""
            ),
        ),
        "uvicorn (h11)": (uvicorn_h11_answer(),) * 2,
        "twisted.web": (twisted_web_answer(),) * 2,
    }
    return heads


class RecordingTransport(asyncio.Transport):
    """Keeps what is written; reading is never really paused (nothing is read from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def data(self) -> bytes:
        return b"".join(self.written)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.7", 50000) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


class Routes:
    """KNOWN is a space on this box; any other host is unknown (the router's 404)."""

    def __init__(self) -> None:
        self.heads: list[RequestHead] = []
        self.target = LocalSocket(host=KNOWN, path=SOCKET)

    def route(self, head: RequestHead) -> Target:
        self.heads.append(head)
        if head.host == KNOWN:
            return self.target
        return plain(404, "404 Not Found: unknown host", label="unknown")

    def reroute(self, head: RequestHead, peer: RemotePeer, why: str) -> Target:
        raise AssertionError("no mesh peer is routed to here")


class Rig:
    """One client connection through a proxy to one pooled upstream connection, in memory."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.routes = Routes()
        self.pool = UpstreamPool(self.clock)
        self.factory = ProxyFactory(self.clock, self.routes, ProxyConfig(), pool=self.pool)
        # Each upstream connection made, with what was written to it: a new one is pooled
        # whenever none is idle (as a dial would, without a socket).
        self.upstreams: list[tuple[UpstreamConnection, RecordingTransport]] = []
        self.client_transport = RecordingTransport()
        self.client: Downstream = self.factory()
        self.client.connection_made(self.client_transport)

    def pool_one(self) -> None:
        if not any(upstream.reusable for upstream in idle_connections(self.pool)):
            transport = RecordingTransport()
            upstream = UpstreamConnection(self.pool, target_key(self.routes.target))
            upstream.connection_made(transport)
            self.pool.release(upstream)
            self.upstreams.append((upstream, transport))

    def request(self, data: bytes, response: bytes | None = OK) -> None:
        """The client sends ``data`` in one read; if it reached a space, the space answers
        ``response`` in one read (None: not yet), and so on for requests that follow it in it."""
        self.pool_one()
        self.client.data_received(data)
        for _ in range(5):  # (a request pipelined in the same read is served after it)
            waiting = [u for u, _ in self.upstreams if u.handler is not None]
            if response is None or not waiting:
                break
            for upstream in waiting:
                upstream.data_received(response)
            self.pool_one()

    def observed(self) -> dict[str, Any]:
        """Everything the comparison looks at."""
        client = self.client
        return {
            "upstream": [parse_requests(transport.data()) for _, transport in self.upstreams],
            "client": self.client_transport.data(),
            "client closing": self.client_transport.closing,
            # (A closed one stays listed here: the recording transport never reports the loss.)
            "upstreams pooled": [
                upstream.reusable and upstream in idle_connections(self.pool)
                for upstream, _ in self.upstreams
            ],
            "deadline": client._deadline,
            "deadline action": client._timer_action,
            "active": client._active is not None,
            "served": client._served,
            "hosts routed": [head.host for head in self.routes.heads],
            "targets routed": [head.target for head in self.routes.heads],
        }

    def close(self) -> None:
        self.client.connection_lost(None)
        for upstream, _ in self.upstreams:
            upstream.connection_lost(None)


def parse_requests(data: bytes) -> list[tuple[bytes, bytes, str, list[tuple[bytes, bytes]]]] | str:
    """What a space would read: method, target, version and headers (names lowercased) of
    each request, or the parser's complaint."""
    requests: list[tuple[bytes, bytes, str, list[tuple[bytes, bytes]]]] = []
    headers: list[tuple[bytes, bytes]] = []
    url = bytearray()

    class Collector:
        def on_message_begin(self) -> None:
            headers.clear()
            url.clear()

        def on_url(self, part: bytes) -> None:
            url.extend(part)

        def on_header(self, name: bytes, value: bytes) -> None:
            headers.append((name.lower(), value))

        def on_headers_complete(self) -> None:
            requests.append((parser.get_method(), bytes(url), parser.get_http_version(), []))
            requests[-1][3].extend(headers)

    parser = httptools.HttpRequestParser(Collector())
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return [*requests, "upgrade"]  # type: ignore[list-item]
    except httptools.HttpParserError as e:
        return f"unparseable: {e}"
    return requests


@contextmanager
def general_path_only() -> Iterator[None]:
    """The recognisers switched off, and every body byte through the parser: every read goes
    the general way."""
    saved = oneread.request, oneread.response
    body_read = Downstream._body_read

    def through_the_parser(self: Downstream, data: bytes) -> None:
        self._body_left = 0
        self.data_received(data)

    oneread.request = lambda *args, **kwargs: None
    oneread.response = lambda *args, **kwargs: None
    Downstream._body_read = through_the_parser  # type: ignore[method-assign]
    try:
        yield
    finally:
        oneread.request, oneread.response = saved
        Downstream._body_read = body_read  # type: ignore[method-assign]


@contextmanager
def counted() -> Iterator[dict[str, int]]:
    """How often each recogniser accepted a read."""
    counts = {"request": 0, "response": 0}
    saved = oneread.request, oneread.response

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            counts[name] += result is not None
            return result

        return call

    oneread.request = wrap("request", saved[0])
    oneread.response = wrap("response", saved[1])
    try:
        yield counts
    finally:
        oneread.request, oneread.response = saved


def stats(state: FrontDoorState) -> dict[str, Any]:
    """The front door's figures."""
    STATS = state.stats
    return {
        "requests": dict(STATS.requests),
        "in_flight": STATS.in_flight,
        "bytes_down": STATS.bytes_down,
        "bytes_up": STATS.bytes_up,
    }


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    requests = {
        key: after["requests"].get(key, 0) - before["requests"].get(key, 0)
        for key in after["requests"]
        if after["requests"].get(key, 0) != before["requests"].get(key, 0)
    }
    return {"requests": requests, **{k: after[k] - before[k] for k in before if k != "requests"}}


def run(
    reads: Sequence[tuple[bytes, bytes | None]],
    general: bool,
    one_read: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A fresh rig through which each (request, response) pair goes in turn; ``one_read``, if
    given, gets the one-read path's counters (lchat_proxy_one_read_responses), which only the
    fast path moves."""
    rig = Rig()
    before = stats(rig.factory.state)
    if general:
        with general_path_only():
            for request, response in reads:
                rig.request(request, response)
    else:
        for request, response in reads:
            rig.request(request, response)
    seen = rig.observed()
    seen["stats"] = stats_delta(before, stats(rig.factory.state))
    if one_read is not None:
        figures = rig.factory.state.stats
        one_read.update(
            as_sent=figures.one_read - figures.one_read_spliced, spliced=figures.one_read_spliced
        )
    rig.close()
    return seen


def with_lines(message: bytes, *lines: bytes) -> bytes:
    """``message`` with ``lines`` added at the end of its head."""
    added = b"".join(line + b"\r\n" for line in lines)
    return message.replace(b"\r\n\r\n", b"\r\n" + added + b"\r\n", 1)


class SameAsGeneralPathTests(SynchronousTestCase):
    def assertSame(self, reads: Sequence[tuple[bytes, bytes | None]]) -> dict[str, Any]:
        fast = run(reads, general=False)
        general = run(reads, general=True)
        self.assertEqual(fast, general)
        return fast

    def test_common_requests_take_the_fast_path(self) -> None:
        """The comparisons below are not vacuous: both recognisers accept the usual traffic,
        and the outcome equals the general path's."""
        with counted() as counts:
            seen = run([(WRK, OK), (BROWSER, OK), (WRK, OK)], general=False)
        self.assertEqual(counts, {"request": 3, "response": 3})
        self.assertEqual(seen["client"], OK * 3)
        self.assertEqual(seen, run([(WRK, OK), (BROWSER, OK), (WRK, OK)], general=True))

    def test_heads_real_servers_send(self) -> None:
        """nginx's, Node's, Go's, uvicorn's (h11), Twisted's and Apache's answers take the one-read
        path (nginx's, Node's and Apache's went the general way before it spliced: a hop-by-hop
        line in the head), and the client gets exactly the general path's bytes: the answer
        with its hop-by-hop lines taken out, every other byte as it came; the connection to the
        space is pooled again."""
        for server, (answer, expected) in real_heads().items():
            with self.subTest(server=server):
                reads = [(WRK, answer), (BROWSER, answer), (WRK, OK)]
                one_read: dict[str, int] = {}
                with counted() as counts:
                    seen = run(reads, general=False, one_read=one_read)
                self.assertEqual(counts, {"request": 3, "response": 3})
                spliced = 2 if expected != answer else 0
                self.assertEqual(one_read, {"as_sent": 3 - spliced, "spliced": spliced})
                self.assertEqual(seen["client"], expected * 2 + OK)
                self.assertEqual(seen["upstreams pooled"], [True])
                self.assertEqual(seen, run(reads, general=True))

    def test_browsers_requests(self) -> None:
        """Chrome's and Firefox's full header sets (cookies, Connection: keep-alive, sec-fetch-*,
        accept-encoding, and Firefox's TE: trailers) take the one-read path, and the space gets
        what the general path sends it: Connection and TE taken out, the rest as it came."""
        for browser, request in BROWSERS.items():
            with self.subTest(browser=browser):
                reads = [(request, NGINX), (request, NGINX), (WRK, OK)]
                with counted() as counts:
                    seen = run(reads, general=False)
                self.assertEqual(counts, {"request": 3, "response": 3})
                self.assertEqual(seen, run(reads, general=True))
                [[(_, _, _, headers), *_]] = seen["upstream"]
                names = [name for name, _ in headers]
                self.assertNotIn(b"connection", names)
                self.assertNotIn(b"te", names)
                self.assertIn(b"cookie", names)

    def test_a_request_that_closes_takes_the_one_read_path(self) -> None:
        """``Connection: close`` (health checks, API tools, wrk's new-connection runs): the
        request and its answer take the one-read path; the space gets what it gets from a
        kept-alive request, the client the answer as it came with ``Connection: close`` added
        last, then the close; its pooled connection to the space stays pooled. The same bytes
        as the general path's, whose head is now the space's as it came too (it was built
        again), and nothing read after it."""
        for closing in (
            with_lines(WRK, b"Connection: close"),
            with_lines(WRK, b"connection:  Close "),
            with_lines(
                BROWSERS["firefox"].replace(b"Connection: keep-alive\r\n", b""),
                b"Connection: close",
            ),
        ):
            for answer, expected in [(OK, OK), *real_heads().values()]:
                with self.subTest(request=closing, answer=answer):
                    reads = [(closing, answer)]
                    with counted() as counts:
                        seen = run(reads, general=False)
                    self.assertEqual(counts, {"request": 1, "response": 1})
                    self.assertEqual(seen, run(reads, general=True))
                    head, body = expected.split(b"\r\n\r\n", 1)
                    self.assertEqual(seen["client"], head + b"\r\nConnection: close\r\n\r\n" + body)
                    self.assertTrue(seen["client closing"])
                    self.assertEqual(seen["upstreams pooled"], [True])
                    [[(_, _, _, headers)]] = seen["upstream"]
                    self.assertNotIn(b"connection", [name for name, _ in headers])
        # A request after the closing one, in a later read, is not served.
        seen = self.assertSame([(with_lines(WRK, b"Connection: close"), OK), (WRK, OK)])
        self.assertEqual(seen["served"], 1)
        self.assertEqual(len(seen["targets routed"]), 1)

    def test_what_the_space_receives(self) -> None:
        """Forwarding headers added, Connection: keep-alive taken out, the rest as it came."""
        seen = self.assertSame([(BROWSER, OK)])
        [[(method, target, version, headers)]] = seen["upstream"]
        self.assertEqual((method, target, version), (b"GET", b"/api/messages?after=12", "1.1"))
        self.assertEqual(
            headers,
            [
                (b"host", b"chat.example.com"),
                (b"user-agent", b"Mozilla/5.0 (X11; Linux x86_64) Chrome/120"),
                (b"accept", b"*/*"),
                (b"cookie", b"_ga=GA1.2; session=ab_cd"),
                (b"sec-fetch-mode", b"cors"),
                (b"x-forwarded-for", b"192.0.2.7"),
                (b"x-forwarded-proto", b"http"),
            ],
        )

    def test_the_remembered_header_lines_follow_each_request(self) -> None:
        """The same header lines again are not checked again, but the request line is each
        request's own, and different lines (another Host) are checked afresh."""
        other = WRK.replace(b"chat.example.com", b"other.example.com")
        seen = self.assertSame(
            [
                (WRK, OK),
                (WRK.replace(b"GET / ", b"HEAD /x "), OK.replace(b"ok\n", b"")),
                (WRK.replace(b"GET / ", b"GET /y?z "), OK),
                (other, OK),
                (WRK, OK),
            ]
        )
        self.assertEqual(seen["hosts routed"], [KNOWN, KNOWN, KNOWN, "other.example.com", KNOWN])
        self.assertEqual(seen["targets routed"], [b"/", b"/x", b"/y?z", b"/", b"/"])

    def test_declined_requests(self) -> None:
        """Each of these goes the general way (and the outcome is the general path's)."""
        declined = [
            WRK.replace(b"GET", b"POST"),
            WRK.replace(b"GET", b"get"),
            WRK.replace(b"HTTP/1.1", b"HTTP/1.0"),
            WRK.replace(b"GET / ", b"GET * "),
            WRK.replace(b"GET / ", b"GET http://chat.example.com/ "),
            WRK.replace(b"\r\n\r\n", b"\r\nContent-Length: 0\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"),
            with_lines(WRK, b"Connection: close, keep-alive"),
            with_lines(WRK, b"Connection: keep-alive", b"Connection: close"),
            with_lines(WRK, b"Connection: closed"),
            WRK.replace(b"\r\n\r\n", b"\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nX-Lchat-Sidecar: 1\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nX_Lchat_Sidecar: 1\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nProxy-Authorization: x\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"),
            with_lines(WRK, b"TE: trailers", b"TE: trailers"),  # (one is taken out, not two)
            with_lines(WRK, b"Connection: keep-alive, TE", b"TE: trailers"),
            with_lines(WRK, b"Keep-Alive: 300"),
            WRK.replace(b"\r\n\r\n", b"\r\nHost: chat.example.com\r\n\r\n"),
            WRK.replace(b"Host: chat.example.com", b"X-Host: chat.example.com"),
            WRK.replace(b"Host: chat", b"Host: \xaachat"),
            WRK.replace(b"\r\n\r\n", b"\r\nX-A: a\tb\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nX-A: \xc3\xa9\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nX A: b\r\n\r\n"),
            WRK.replace(b"\r\n\r\n", b"\r\nX-A: b\r\n c\r\n\r\n"),
            WRK.replace(b"\r\n", b"\n"),
            WRK + WRK,  # pipelined: two in one read
            WRK[:-2],  # not finished
        ]
        for request in declined:
            with self.subTest(request=request):
                self.assertIsNone(oneread.request(request, 8192, 100))
                self.assertSame([(request, OK)])

    def test_declined_responses(self) -> None:
        declined = [
            OK.replace(b"HTTP/1.1", b"HTTP/1.0"),
            OK.replace(b"200 OK", b"200"),
            OK.replace(b"200 OK", b"204 No Content").replace(b"ok\n", b""),
            OK.replace(b"200 OK", b"304 Not Modified"),
            OK.replace(b"200 OK", b"101 Switching Protocols"),
            b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
            OK.replace(b"Content-Length: 3", b"Content-Length: 2"),
            OK.replace(b"Content-Length: 3", b"Content-Length: 4"),
            OK.replace(b"Content-Length: 3", b"Content-Length: +3"),
            OK.replace(b"Content-Length: 3", b"Content-Length: 3\r\nContent-Length: 3"),
            OK.replace(b"Content-Length: 3", b"Transfer-Encoding: chunked").replace(
                b"ok\n", b"3\r\nok\n\r\n0\r\n\r\n"
            ),
            OK.replace(b"Content-Length: 3\r\n", b""),
            OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"),
            OK.replace(b"\r\n\r\n", b"\r\nX-Lchat-Refused: stopping\r\n\r\n"),
            OK.replace(b"\r\n\r\n", b"\r\nX_Lchat_Sidecar: 1\r\n\r\n"),
            OK.replace(b"\r\n\r\n", b"\r\nX-A: a\tb\r\n\r\n"),
            # The hop-by-hop lines the splice takes out, but not as it takes them.
            with_lines(OK, b"Connection: keep-alive, x-a"),  # (names a header to drop)
            with_lines(OK, b"Connection: keep-alive, close"),
            with_lines(OK, b"Connection: keep-alive,"),
            with_lines(OK, b"Connection: keep-alive", b"Connection: close"),
            with_lines(OK, b"Connection: keep-alive", b"Connection: keep-alive"),
            with_lines(OK, b"Keep-Alive: timeout=5", b"Keep-Alive: max=100"),
            with_lines(OK, b"Connection: close", b"Keep-Alive: timeout=5"),
            with_lines(OK, b"Connection: keep-alive", b"Proxy-Connection: keep-alive"),
            with_lines(OK, b"Connection: keep-alive", b"TE: trailers"),
            with_lines(OK, b"Connection: keep-alive", b"Trailer: x"),
            with_lines(OK, b"Keep-Alive: timeout=5", b"X-Lchat-Refused: stopping"),
            with_lines(OK, b"Connection: keep-alive", b" folded"),
            with_lines(OK, b"Connection: keep-alive\tx"),
            OK + b"HTTP/1.1 200 OK\r\n",  # more than one response
            OK[:-1],  # not all here
        ]
        for response in declined:
            with self.subTest(response=response):
                self.assertIsNone(oneread.response(response))
                self.assertSame([(WRK, response), (WRK, OK)])

    def test_bytes_after_a_response_retire_its_connection(self) -> None:
        """A space that sends more than the response (the start of another nobody asked for):
        the connection is out of step and never reused, so the next request gets its own answer
        on a new one instead of a 502 (or, on the fast path, the stale bytes ignored)."""
        seen = self.assertSame([(WRK, OK + b"HTTP/1.1 200 OK\r\n"), (WRK, OK)])
        self.assertEqual(seen["client"], OK * 2)
        self.assertEqual(seen["upstreams pooled"], [False, True])

    def test_a_body_past_the_parser(self) -> None:
        """A Content-Length body read by read past the parser (Downstream._body_read): the space
        gets the same bytes, the request after it in the body's last read is served, and a body
        over LCHAT_MAX_BODY is refused the same way."""
        post = b"POST /up HTTP/1.1\r\nHost: chat.example.com\r\nContent-Length: 10\r\n\r\n"
        seen = self.assertSame(
            [(post + b"abc", None), (b"defg", None), (b"hij" + WRK, OK), (WRK, OK)]
        )
        self.assertEqual(seen["client"], OK * 3)
        requests = [request for conn in seen["upstream"] for request in conn]
        self.assertEqual(sorted(r[1] for r in requests), [b"/", b"/", b"/up"])
        self.assertSame([(post + b"abc", None), (b"defghij", OK), (WRK, OK)])
        # The body's end and a bad request after it; a close after the answer.
        self.assertSame([(post, None), (b"abcdefghij" + b"BAD\r\n\r\n", OK)])
        closing = post.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        self.assertSame([(closing + b"abc", None), (b"defghij" + WRK, OK)])
        big = post.replace(b"10", b"%d" % (200 * 1024 * 1024))
        self.assertSame([(big + b"abc", None), (b"x" * 1000, None)])

    def test_local_answers_and_limits(self) -> None:
        """An unknown host's 404, and heads over the limits, as the general path answers."""
        unknown = WRK.replace(b"chat.example", b"nowhere.example")
        self.assertSame([(unknown, OK), (WRK, OK)])
        many = WRK.replace(b"\r\n\r\n", b"\r\n" + b"X-A: b\r\n" * 120 + b"\r\n")
        self.assertSame([(many, OK)])
        long = WRK.replace(b"GET / ", b"GET /" + b"a" * 9000 + b" ")
        self.assertSame([(long, OK)])

    def test_the_response_head_waits_for_a_wake_header(self) -> None:
        """A target that adds headers to the response (a request that waited for a wake) is
        answered the general way."""
        rig = Rig()
        rig.routes.target = LocalSocket(
            host=KNOWN, path=SOCKET, response_headers=((b"X-Lchat-Wake", b"1.2s"),)
        )
        with counted() as counts:
            rig.request(WRK)
        self.assertEqual(counts["response"], 1)  # recognised, and declined by the handler
        self.assertIn(b"X-Lchat-Wake: 1.2s\r\n", rig.client_transport.data())
        self.assertTrue(rig.client_transport.data().endswith(b"\r\n\r\nok\n"))
        rig.close()

    def test_a_draining_router_closes_after_the_answer(self) -> None:
        rig = Rig()
        rig.factory.draining = True
        rig.request(WRK)
        self.assertIn(b"Connection: close", rig.client_transport.data())
        self.assertTrue(rig.client_transport.closing)
        rig.close()


# --- generated inputs ----------------------------------------------------------------------------

_HEADER_LINES = st.sampled_from(
    [
        b"Host: chat.example.com",
        b"Host: CHAT.example.com",
        b"Host: chat.example.com:80",
        b"Host:chat.example.com",
        b"Host:   chat.example.com   ",
        b"host: other.example.com",
        b"Host: ",
        b"Host: chat.example.com, x",
        b"Connection: keep-alive",
        b"connection: Keep-Alive",
        b"Connection: close",
        b"Connection: keep-alive, x-a",
        b"Connection: upgrade",
        b"Upgrade: websocket",
        b"Keep-Alive: timeout=5",
        b"Content-Length: 0",
        b"Content-Length: 5",
        b"Transfer-Encoding: chunked",
        b"Expect: 100-continue",
        b"X-Forwarded-For: 10.0.0.1",
        b"X-Forwarded-Proto: https",
        b"Forwarded: for=x",
        b"X-Lchat-Sidecar: 1",
        b"X-Lchat-Mesh-Forwarded: x",
        b"X_Forwarded_For: 1",
        b"Proxy-Connection: keep-alive",
        b"TE: trailers",
        b"te: trailers, deflate;q=0.5",
        b"Connection: keep-alive, TE",
        b"Trailer: x",
        b"X-A: b",
        b"X-A:b",
        b"X-A: ",
        b"X-A: a_b",
        b"X-A: caf\xc3\xa9",
        b"X-A: a\tb",
        b"X-A: a\x7fb",
        b"X-A:  spaced  ",
        b"X A: b",
        b"X-A : b",
        b": b",
        b" X-A: b",
        b"Cookie: _ga=1; a_b=2",
        b"User-Agent: Mozilla/5.0 (X11; Linux x86_64)",
    ]
)
_REQUEST_LINES = st.sampled_from(
    [
        b"GET / HTTP/1.1",
        b"HEAD / HTTP/1.1",
        b"GET /a/b?c=d&e HTTP/1.1",
        b"GET /%7e~!$&'()*+,;=:@ HTTP/1.1",
        b"POST / HTTP/1.1",
        b"DELETE / HTTP/1.1",
        b"GET / HTTP/1.0",
        b"GET / HTTP/2.0",
        b"GET /",
        b"GET  / HTTP/1.1",
        b"GET / HTTP/1.1 ",
        b"GET * HTTP/1.1",
        b"OPTIONS * HTTP/1.1",
        b"GET http://chat.example.com/ HTTP/1.1",
        b"GET /\xc3\xa9 HTTP/1.1",
        b"CONNECT chat.example.com:443 HTTP/1.1",
    ]
)


@st.composite
def requests(draw: Any) -> bytes:
    eol = draw(st.sampled_from([b"\r\n"] * 6 + [b"\n"]))
    lines = [draw(_REQUEST_LINES), *draw(st.lists(_HEADER_LINES, max_size=6))]
    data = eol.join(lines) + eol + eol
    if draw(st.booleans()):
        data += draw(st.sampled_from([b"", b"hello", b"0\r\n\r\n", WRK]))
    return data


_RESPONSE_LINES = st.sampled_from(
    [
        b"Content-Type: text/plain",
        b"Content-Length: 3",
        b"Content-Length: 3",
        b"Content-Length:3",
        b"Content-Length:  3  ",
        b"Content-Length: 2",
        b"Content-Length: 03",
        b"Content-Length: 3, 3",
        b"Transfer-Encoding: chunked",
        b"Connection: keep-alive",
        b"Connection: Keep-Alive",
        b"connection:keep-alive ",
        b"Connection: Upgrade, Keep-Alive",
        b"Connection: keep-alive, x-a",
        b"Connection: keep-alive,",
        b"Connection: close",
        b"Connection: close, keep-alive",
        b"Keep-Alive: timeout=5",
        b"Keep-Alive: timeout=5, max=100",
        b"Upgrade: h2,h2c",
        b"TE: trailers",
        b"Trailer: x",
        b"Proxy-Connection: keep-alive",
        b"X-Lchat-Refused: stopping",
        b"X-Lchat-Sidecar: 1",
        b"X_A: b",
        b"Proxy-Authenticate: x",
        b"Set-Cookie: a_b=c",
        b"X-A: a\tb",
        b"X-A: caf\xc3\xa9",
        b"Server: backend",
    ]
)


@st.composite
def responses(draw: Any) -> bytes:
    status = draw(
        st.sampled_from(
            [
                b"200 OK",
                b"201 Created",
                b"404 Not Found",
                b"503 Busy",
                b"204 No Content",
                b"304 Not Modified",
                b"200 ",
                b"200",
            ]
        )
    )
    version = draw(st.sampled_from([b"HTTP/1.1"] * 5 + [b"HTTP/1.0"]))
    lines = [version + b" " + status, *draw(st.lists(_RESPONSE_LINES, max_size=5))]
    body = draw(st.sampled_from([b"ok\n", b"", b"ok", b"ok\nX", b"3\r\nok\n\r\n0\r\n\r\n"]))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


# The splice's own lines (taken out when each name comes once), and hop-by-hop or special lines
# that still make a head go the general way.
_SPLICED_LINES = st.sampled_from(
    [
        b"Connection: keep-alive",
        b"connection:Keep-Alive ",
        b"Connection: Upgrade, Keep-Alive",
        b"Keep-Alive: timeout=5",
        b"Keep-Alive: timeout=5, max=100",
        b"Upgrade: h2,h2c",
    ]
)
_STILL_DECLINED = st.sampled_from(
    [
        b"Connection: close",
        b"Connection: keep-alive, x-a",
        b"Connection: keep-alive, close",
        b"Proxy-Connection: keep-alive",
        b"TE: trailers",
        b"Trailer: x",
        b"Transfer-Encoding: chunked",
        b"X-Lchat-Refused: stopping",
        b"X_A: b",
    ]
)


@st.composite
def spliced_responses(draw: Any) -> tuple[bytes, bool]:
    """A real server's answer (its own hop-by-hop lines out) with the splice's lines put in at
    any positions, and perhaps a line that must still decline; and whether the recognisers
    take it (each spliced name once, nothing else special)."""
    answer = draw(st.sampled_from([NGINX, NODE, NODE_BARE, GO, APACHE, OK]))
    head, body = answer.split(b"\r\n\r\n", 1)
    status, *lines = head.split(b"\r\n")
    lines = [line for line in lines if line.split(b":")[0].lower() not in http.RESPONSE_SPLICED]
    added = draw(st.lists(_SPLICED_LINES, max_size=3))
    declined = draw(st.lists(_STILL_DECLINED, max_size=1))
    for line in added + declined:
        lines.insert(draw(st.integers(0, len(lines))), line)
    names = [line.split(b":")[0].lower() for line in added]
    taken = not declined and len(set(names)) == len(names)
    return b"\r\n".join([status, *lines]) + b"\r\n\r\n" + body, taken


class GeneratedTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(case=spliced_responses())
    def test_spliced_responses(self, case: tuple[bytes, bool]) -> None:
        """Keep-alive, Keep-Alive and Upgrade lines anywhere in a real server's head: taken out
        exactly as the general path takes them out (then the same bytes reach the client), and
        any other hop-by-hop or special line, or a name twice, still declines."""
        response, taken = case
        whole = PATTERNS.response(response)
        self.assertEqual(whole is not None, taken)
        self.assertEqual(oneread.response(response), whole)
        if whole is not None:
            kept = [
                line
                for line in response.split(b"\r\n\r\n")[0].split(b"\r\n")
                if line.split(b":")[0].lower() not in http.RESPONSE_SPLICED
            ]
            self.assertEqual(whole[2], b"\r\n".join(kept) + b"\r\n\r\nok\n")
        reads = [(WRK, response), (WRK, OK)]
        self.assertEqual(run(reads, general=False), run(reads, general=True))

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(first=requests(), second=requests())
    def test_requests(self, first: bytes, second: bytes) -> None:
        """Any request (then any other on the same connection, so that the remembered lines
        are exercised), answered OK: the same as the general path."""
        reads = [(first, OK), (second, OK), (WRK, OK)]
        self.assertEqual(run(reads, general=False), run(reads, general=True))

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(response=responses(), head=st.booleans())
    def test_responses(self, response: bytes, head: bool) -> None:
        """Any response (to a GET or a HEAD), then a usual exchange: the same as the general
        path."""
        request = WRK.replace(b"GET", b"HEAD") if head else WRK
        reads = [(request, response), (WRK, OK)]
        self.assertEqual(run(reads, general=False), run(reads, general=True))


def _mutated(draw: Any, data: bytes) -> bytes:
    """``data`` with up to three bytes inserted, dropped or replaced (the edges the explicit
    lines above do not list)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(out)))
        byte = draw(st.sampled_from(b"\r\n \t:_/-aAzZ09\x00\x7f\x80\xff"))
        how = draw(st.sampled_from(["insert", "drop", "replace"]))
        if how == "insert" or not out:
            out[at:at] = bytes([byte])
        elif how == "drop":
            del out[min(at, len(out) - 1)]
        else:
            out[min(at, len(out) - 1)] = byte
    return bytes(out)


@st.composite
def mutated_requests(draw: Any) -> bytes:
    return _mutated(draw, draw(requests()))


@st.composite
def mutated_responses(draw: Any) -> bytes:
    return _mutated(draw, draw(responses()))


_LIMITS = st.sampled_from([(8192, 100), (8192, 2), (48, 100)])


def _patterns(compiled: ModuleType | None = None) -> ModuleType:
    """lchat.proxy.oneread as loaded where lchat/proxy/_oneread_c is not built (or is
    ``compiled``): its recognisers are the patterns, the reference the C scanners are held to."""
    import lchat.proxy as package

    spec = importlib.util.spec_from_file_location("lchat.proxy.oneread", oneread.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    built = package.__dict__.pop("_oneread_c", None)
    with patch.dict(sys.modules, {"lchat.proxy._oneread_c": compiled}):  # (None: import fails)
        spec.loader.exec_module(module)
    if built is not None:
        package._oneread_c = built
    return module


PATTERNS = _patterns()


class CompiledRecognisersTests(SynchronousTestCase):
    """The recognisers in C (lchat/proxy/_oneread_c.pyx), when built, against the reference ones
    (the patterns in oneread.py): the same answer on every input, so that everything above,
    which runs whichever is installed, holds for both."""

    def setUp(self) -> None:
        if not oneread.COMPILED:
            raise SkipTest("lchat.proxy._oneread_c is not built here")

    @settings(max_examples=3000, deadline=None, derandomize=True)
    @given(first=mutated_requests(), second=mutated_requests(), limits=_LIMITS)
    def test_requests(self, first: bytes, second: bytes, limits: tuple[int, int]) -> None:
        for previous in (
            None,
            PATTERNS.request(first, 8192, 100),
            PATTERNS.request(WRK, 8192, 100),
        ):
            self.assertEqual(
                oneread.request(second, *limits, previous),
                PATTERNS.request(second, *limits, previous),
            )
        self.assertEqual(oneread.request(first, *limits), PATTERNS.request(first, *limits))

    @settings(max_examples=3000, deadline=None, derandomize=True)
    @given(response=mutated_responses())
    def test_responses(self, response: bytes) -> None:
        self.assertEqual(oneread.response(response), PATTERNS.response(response))

    def test_explicit(self) -> None:
        for request in (
            WRK,
            BROWSER,
            WRK.replace(b"GET", b"HEAD"),
            BROWSER.replace(b"keep-alive", b"Keep-Alive "),
        ):
            self.assertEqual(
                oneread.request(request, 8192, 100), PATTERNS.request(request, 8192, 100)
            )
            self.assertIsNotNone(oneread.request(request, 8192, 100))
        for response in (OK, OK.replace(b"Content-Length: 3", b"Content-Length:  3  ")):
            self.assertEqual(oneread.response(response), (200, 3, response))
            self.assertEqual(PATTERNS.response(response), (200, 3, response))
        for response, expected in real_heads().values():
            self.assertEqual(oneread.response(response), (200, 3, expected))
            self.assertEqual(PATTERNS.response(response), (200, 3, expected))


class WithoutLinesTests(SynchronousTestCase):
    """lchat.proxy.http.without_lines, the general path's splice: the named lines out, every
    other byte as it came, or None where lines and parsed headers might not pair up."""

    def test_the_named_lines_go(self) -> None:
        head = NODE_BARE[: NODE_BARE.index(b"\r\n\r\n") + 4]
        self.assertEqual(
            http.without_lines(head, http.RESPONSE_SPLICED),
            head.replace(b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n", b""),
        )
        self.assertEqual(http.without_lines(head, frozenset()), head)
        only = b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\n\r\n"
        self.assertEqual(
            http.without_lines(only, http.RESPONSE_SPLICED), b"HTTP/1.1 200 OK\r\n\r\n"
        )

    def test_lines_that_are_not_one_field_each(self) -> None:
        for lines in (
            b"Connection: keep-alive\r\n x-a\r\n",  # folded onto the Connection line
            b"Connection: keep-alive\nX-A: b\r\n",  # a bare LF
            b"Connection: keep-alive\rX-A: b\r\n",  # a bare CR
            b"Connection : keep-alive\r\n",
            b"X-A\r\n",
            b": b\r\n",
        ):
            with self.subTest(lines=lines):
                head = b"HTTP/1.1 200 OK\r\n" + lines + b"\r\n"
                self.assertIsNone(http.without_lines(head, http.RESPONSE_SPLICED))


class StaleBuildTests(SynchronousTestCase):
    def test_a_build_of_an_older_pyx_is_not_used(self) -> None:
        """A C module built before ``response`` returned the client's bytes (a checkout updated
        without a rebuild) would answer in the old form: the patterns serve instead, and the
        start line says why and what to do."""
        stale = ModuleType("lchat.proxy._oneread_c")  # (no API: built from the first .pyx)
        stale.response = lambda data: (200, 3)  # type: ignore[attr-defined]
        loaded = _patterns(stale)
        self.assertFalse(loaded.COMPILED)
        self.assertIn("older version", loaded.implementation())
        self.assertIn("make install", loaded.implementation())
        self.assertEqual(loaded.response(NGINX), PATTERNS.response(NGINX))
        self.assertEqual(len(loaded.response(NGINX)), 3)
        if oneread.COMPILED:
            self.assertEqual(oneread.API, oneread._oneread_c.API)


# (The module's Downstream is the one the tests drive: keep the import's purpose explicit.)
assert downstream.Downstream is Downstream


class DeclinedNamesTests(SynchronousTestCase):
    """The recognisers' declined-name lists are made from the header policy's shared sets
    (lchat.proxy.http), and both recognisers, patterns and C, decline every name in them."""

    def test_the_lists_are_the_shared_sets(self) -> None:
        for declined, special in (
            (oneread.REQUEST_DECLINED, http.REQUEST_SPECIAL),
            (oneread.RESPONSE_DECLINED, http.RESPONSE_SPECIAL),
        ):
            covered = {name for name in special if name.startswith(http.SPECIAL_PREFIXES)}
            self.assertEqual(set(declined), special - covered)
        # What the general path acts on is in the sets (their sources, by name).
        self.assertLessEqual(
            http.HOP_BY_HOP | http.FORWARDING | http.INTERNAL, http.REQUEST_SPECIAL
        )
        self.assertLessEqual(http.HOP_BY_HOP | http.INTERNAL, http.RESPONSE_SPECIAL)

    def recognisers(self) -> list[tuple[Callable[..., Any], Callable[[bytes], Any]]]:
        both: list[tuple[Callable[..., Any], Callable[[bytes], Any]]] = [
            (PATTERNS.request, PATTERNS.response)
        ]
        if oneread.COMPILED:
            both.append((oneread.request, oneread.response))
        return both

    def test_every_special_name_is_declined(self) -> None:
        extra = [b"x-lchat-anything", b"proxy-anything", b"a_b"]
        for request, response in self.recognisers():
            self.assertIsNotNone(request(WRK, 8192, 100))
            self.assertIsNotNone(response(OK))
            for name in sorted(http.REQUEST_SPECIAL) + extra:
                line = name.title() + b": 1\r\n"
                answer = request(WRK[:-2] + line + b"\r\n", 8192, 100)
                if name == b"te":  # (taken out, whatever it says: the general path drops it)
                    self.assertEqual(answer.lines if answer else None, WRK[WRK.index(b"Host") : -2])
                else:
                    self.assertIsNone(answer, name)
            for name in sorted(http.RESPONSE_SPECIAL) + extra:
                line = name.title() + b": 1\r\n"
                answer = response(OK.replace(b"\r\n\r\n", b"\r\n" + line + b"\r\n"))
                if name in http.RESPONSE_SPLICED and name != b"connection":
                    self.assertEqual(answer, (200, 3, OK), name)  # (taken out, whatever it says)
                else:
                    self.assertIsNone(answer, name)

    def test_other_names_are_not(self) -> None:
        for request, response in self.recognisers():
            for name in (b"Accept", b"X-Lchat", b"Proxy", b"Ted", b"Expected", b"Forwarded-By"):
                line = name + b": 1\r\n"
                self.assertIsNotNone(request(WRK[:-2] + line + b"\r\n", 8192, 100), name)
                self.assertIsNotNone(response(OK.replace(b"\r\n\r\n", b"\r\n" + line + b"\r\n")))


# --- over real sockets ---------------------------------------------------------------------------


def node_like(conn: Backend) -> None:
    """A backend answering each request as Node's http does (NODE: Connection: keep-alive and
    Keep-Alive: timeout=5 in its head), one write per answer."""
    while b"\r\n\r\n" in conn.buffer:
        _, _, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
        conn.buffer = bytearray(rest)
        conn.transport.write(NODE)


class RealProxyTests(ProxyTestCase):
    """The proxy on a real listener, a real client, a real unix-socket backend sending Node's
    head: once as shipped, once on the general path only."""

    @inlineCallbacks
    def exchange(self) -> Any:
        """Two requests on one kept-alive client connection; what the client and the space got,
        and the front door's metrics as a Prometheus scrape renders them."""
        backend = BackendFactory(node_like)
        self.runs = getattr(self, "runs", 0) + 1  # (each run its own backend socket)
        path = os.path.join(self.dir, f"run{self.runs}.sock")
        self.router.targets[KNOWN] = LocalSocket(KNOWN, path)
        yield self.backend(backend, path)
        yield self.proxy()
        client = yield self.connect()
        client.transport.write(WRK)
        yield self.until(lambda: client.received.count(b"ok\n") == 1)
        client.transport.write(FIREFOX)
        yield self.until(lambda: client.received.count(b"ok\n") == 2)
        client.transport.loseConnection()
        yield client.closed
        registry = CollectorRegistry()
        registry.register(self.factory.state.collector)
        scrape = generate_latest(registry).decode()
        return bytes(client.received), bytes(backend.received), backend.connections, scrape

    @inlineCallbacks
    def test_a_node_like_head_takes_the_one_read_path(self) -> Any:
        """The client gets exactly the general path's bytes (the head with Connection and
        Keep-Alive taken out, every other byte as it came), the space gets the same requests
        on one pooled connection, and lchat_proxy_one_read_responses counts both answers as
        spliced (the general path's run: none)."""
        client, space, connections, scrape = yield self.exchange()
        expected = NODE.replace(b"Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n", b"")
        self.assertEqual(client, expected * 2)
        self.assertEqual(connections, 1)
        self.assertIn('lchat_proxy_one_read_responses_total{head="spliced"} 2.0', scrape)
        self.assertIn('lchat_proxy_one_read_responses_total{head="as_sent"} 0.0', scrape)
        with general_path_only():
            general = yield self.exchange()
        self.assertEqual((client, space, connections), general[:3])
        self.assertIn('lchat_proxy_one_read_responses_total{head="spliced"} 0.0', general[3])

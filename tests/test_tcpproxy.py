"""The bucket proxy of tests/tcpproxy.py: what the failover tests build on.

Against moto's server (tests/s3servers.py) with our own S3 client (``S3Store`` on the reactor, its
traffic through the proxy): pass-through with keep-alive, ``cut()``, ``blackhole()`` and ``hold()``
with the late write. Against a small threaded HTTP/1.1 server with raw blocking sockets (no reactor
involved: the proxy has its own thread): per-connection order behind a held request, chunked
bodies, a client that leaves, half-closes, garbage, a dead upstream and ``close()``. The framing
parser is checked on its own with hypothesis.
"""

from __future__ import annotations

import contextlib
import http.server
import itertools
import os
import socket
import struct
import threading
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.trial.unittest import TestCase

from lchat.objstore import NotFound, ObjectStore, StoreUnavailable
from lchat.objstore.s3 import S3Store
from tests import s3servers
from tests.tcpproxy import (
    _REQUEST_FIRST,
    _REQUEST_LINE,
    _STATUS_LINE,
    BucketProxy,
    Mode,
    _body_framing,
    _Event,
    _Framing,
    _MessageStream,
    _parse_head,
    request_matcher,
)

reactor: Any = _reactor


async def _in_thread(f: Any, *args: Any) -> Any:
    return await deferToThreadPool(reactor, reactor.getThreadPool(), f, *args)


class MotoThroughProxyTests(TestCase):
    """Our S3 client, on the reactor, through the proxy to moto."""

    timeout = 60

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        return Deferred.fromCoroutine(self._setup())

    async def _setup(self) -> None:
        self.server = await s3servers.shared_server("moto")
        self.bucket = await self.server.new_bucket()
        self.proxy = BucketProxy("127.0.0.1", self.server.port).start()
        self.addCleanup(self.proxy.close)
        self.direct = self.store()  # straight to moto: what really is in the bucket

    def tearDown(self) -> None:
        self.assertEqual(self.proxy.errors, [])

    def store(self, **options: Any) -> S3Store:
        store = s3servers.store_for(self.server, self.bucket, **options)
        self.addCleanup(store.close)
        return store

    def proxied(self, **options: Any) -> S3Store:
        return self.store(endpoint=self.proxy.endpoint, **options)

    async def failure(self, store: ObjectStore, key: str) -> tuple[StoreUnavailable, float]:
        started = time.monotonic()
        try:
            await store.get(key)
        except StoreUnavailable as e:
            return e, time.monotonic() - started
        raise AssertionError(f"a GET of {key!r} through the proxy succeeded")

    def test_pass_through_put_get_list_head_delete(self) -> Deferred[None]:
        async def go() -> None:
            store = self.proxied()
            await store.put("a/one", b"first")
            self.assertEqual((await store.get("a/one")).body, b"first")
            self.assertEqual([o.key for o in await store.list("a/")], ["a/one"])
            self.assertEqual((await store.head("a/one")).size, 5)
            await store.delete("a/one")
            with self.assertRaises(NotFound):
                await self.direct.head("a/one")
            seen = [(e.method, e.status) for e in self.proxy.requests]
            self.assertEqual(
                seen, [("PUT", 200), ("GET", 200), ("GET", 200), ("HEAD", 200), ("DELETE", 204)]
            )
            # (moto answers every request with "Connection: close": a connection per request here;
            # keep-alive through the proxy is RawProxyTests.test_keep_alive.)
            stats = self.proxy.stats()
            self.assertEqual((stats.requests_up, stats.responses_down), (5, 5))
            self.assertGreater(stats.bytes_up, 0)
            self.assertGreater(stats.bytes_down, 0)

        return Deferred.fromCoroutine(go())

    def test_cut_fails_fast_then_heals(self) -> Deferred[None]:
        async def go() -> None:
            # A 30 s timeout the failure must come well within, and one retry after a backoff.
            store = self.proxied(timeout=30.0, retries=1)
            await store.put("k", b"v")  # leaves a pooled keep-alive connection to be reset
            self.proxy.cut()
            self.assertIs(self.proxy.mode, Mode.CUT)
            e, took = await self.failure(store, "k")
            self.assertLess(took, 10.0)
            # A reset, seen by the client as a reset or a lost connection (when it comes before
            # the request is written, or after): never an answer.
            self.assertTrue(
                any(w in str(e).lower() for w in ("reset", "lost", "closed", "aborted")), str(e)
            )
            # New connections are accepted and reset at once: no answer ever.
            with contextlib.suppress(ConnectionResetError):
                sock = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=5)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                self.assertEqual(sock.recv(100), b"")
                sock.close()
            self.proxy.pass_through()
            self.assertEqual((await store.get("k")).body, b"v")  # same port, service restored

        return Deferred.fromCoroutine(go())

    def test_blackhole_times_out_then_heals(self) -> Deferred[None]:
        async def go() -> None:
            store = self.proxied(timeout=0.5, retries=0)
            await store.put("k", b"v")
            self.proxy.blackhole()
            e, _ = await self.failure(store, "k")
            self.assertIn("no answer within", str(e))
            last = self.proxy.requests[-1]
            self.assertEqual((last.method, last.status, last.dropped), ("GET", None, True))
            self.proxy.pass_through()
            self.assertEqual((await store.get("k")).body, b"v")

        return Deferred.fromCoroutine(go())

    def test_held_put_lands_after_its_client_gave_up(self) -> Deferred[None]:
        async def go() -> None:
            await self.direct.put("other", b"readable")
            self.proxy.hold(request_matcher("PUT", "/late"))
            writer = self.proxied(timeout=1.0, retries=0)
            put = Deferred.fromCoroutine(writer.put("late", b"written late"))
            (held,) = await self.proxy.until_held(1)
            self.assertEqual((held.method, held.path), ("PUT", f"/{self.bucket}/late"))
            # Meanwhile another connection's GET is not held up.
            reader = self.proxied()
            self.assertEqual((await reader.get("other")).body, b"readable")
            with self.assertRaises(StoreUnavailable):
                await put  # the writer timed out and gave up (its connection aborted)
            with self.assertRaises(NotFound):
                await self.direct.head("late")
            self.assertTrue(held.complete)
            self.assertEqual(self.proxy.release_held(), [held])
            self.assertEqual(await _in_thread(held.wait_answered, 10.0), 200)
            self.assertEqual((await self.direct.get("late")).body, b"written late")
            self.assertEqual(self.proxy.held, [])
            self.assertTrue(held.raw.endswith(b"\r\n\r\nwritten late"), held.raw)
            late = [e for e in self.proxy.requests if e.held]
            self.assertEqual([(e.method, e.status) for e in late], [("PUT", 200)])

        return Deferred.fromCoroutine(go())

    def test_held_put_survives_a_cut(self) -> Deferred[None]:
        async def go() -> None:
            self.proxy.hold(request_matcher("PUT"))
            writer = self.proxied(timeout=10.0, retries=0)
            put = Deferred.fromCoroutine(writer.put("partitioned", b"in the network"))
            await self.proxy.until_held(1)
            self.proxy.cut()  # the box loses the bucket with its write in flight
            with self.assertRaises(StoreUnavailable):
                await put
            with self.assertRaises(NotFound):
                await self.direct.head("partitioned")
            (released,) = self.proxy.release_held()  # delivered though the proxy is still cut
            self.assertEqual(await _in_thread(released.wait_answered, 10.0), 200)
            self.assertEqual((await self.direct.get("partitioned")).body, b"in the network")
            self.assertIs(self.proxy.mode, Mode.CUT)

        return Deferred.fromCoroutine(go())


# -- a plain HTTP/1.1 server and raw clients --------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Upstream

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def _answer(self) -> None:
        body = self._body()
        with self.server.lock:
            self.server.received.append((self.command, self.path, body))
        reply = f"{self.command} {self.path} {len(body)}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_PUT = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests reset connections on purpose


class _Upstream(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.received: list[tuple[str, str, bytes]] = []
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        port: int = self.server_address[1]
        return port

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a reset connection, a request it could not parse: the tests mean them

    def paths(self) -> list[str]:
        with self.lock:
            return [path for _, path, _ in self.received]

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(5)


def _request(method: str, path: str, body: bytes = b"") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: upstream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """One Content-Length response from ``sock`` (``buf`` keeps what was read beyond it)."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"EOF before a response head: {bytes(buf)!r}")
        buf += data
    head, _, _ = bytes(buf).partition(b"\r\n\r\n")
    del buf[: len(head) + 4]
    parsed = _parse_head(head + b"\r\n\r\n", _STATUS_LINE)
    assert parsed is not None, head
    length = int(parsed[1].get("content-length", "0"))
    while len(buf) < length:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("EOF in a response body")
        buf += data
    body = bytes(buf[:length])
    del buf[:length]
    return int(parsed[0].group(1)), body


def _read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _cpu_seconds(proxy: BucketProxy) -> float:
    """The CPU time the proxy's thread has used (Linux: /proc/self/task/TID/stat)."""
    thread = proxy._thread
    assert thread is not None and thread.native_id is not None
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wait_until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.01)


class RawProxyTests(TestCase):
    """Blocking sockets through the proxy to a plain HTTP/1.1 server (no reactor involved)."""

    timeout = 60

    def setUp(self) -> None:
        self.upstream = _Upstream()
        self.addCleanup(self.upstream.stop)
        self.proxy = BucketProxy("127.0.0.1", self.upstream.port).start()
        self.addCleanup(self.proxy.close)

    def tearDown(self) -> None:
        self.assertEqual(self.proxy.errors, [])

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=10)
        self.addCleanup(sock.close)
        return sock

    def test_keeps_order_behind_a_held_request(self) -> None:
        self.proxy.hold(request_matcher("PUT"))
        first = self.connect()
        # Pipelined: a held PUT, then a GET that must wait behind it on the same connection.
        first.sendall(_request("PUT", "/held", b"hello") + _request("GET", "/after"))
        (held,) = self.proxy.wait_held(1, timeout=10)
        _wait_until(lambda: held.complete, "the held PUT's body arrived")
        other = self.connect()
        other.sendall(_request("GET", "/other"))
        self.assertEqual(_read_response(other, bytearray()), (200, b"GET /other 0"))
        self.assertEqual(self.upstream.paths(), ["/other"])
        self.assertNotIn("/after", [e.path for e in self.proxy.requests])  # not even parsed
        self.proxy.release_held()
        buf = bytearray()
        self.assertEqual(_read_response(first, buf), (200, b"PUT /held 5"))
        self.assertEqual(_read_response(first, buf), (200, b"GET /after 0"))
        self.assertEqual(self.upstream.paths(), ["/other", "/held", "/after"])
        self.assertEqual(held.status, 200)

    def test_keep_alive(self) -> None:
        sock = self.connect()
        buf = bytearray()
        for i in range(3):
            sock.sendall(_request("GET", f"/k{i}"))
            self.assertEqual(_read_response(sock, buf), (200, f"GET /k{i} 0".encode()))
        stats = self.proxy.stats()
        self.assertEqual((stats.connections, stats.requests_up, stats.responses_down), (1, 3, 3))

    def test_pipelined_requests_pass_in_order(self) -> None:
        sock = self.connect()
        sock.sendall(b"".join(_request("PUT", f"/p{i}", b"x" * i) for i in range(5)))
        buf = bytearray()
        for i in range(5):
            self.assertEqual(_read_response(sock, buf), (200, f"PUT /p{i} {i}".encode()))
        self.assertEqual([e.status for e in self.proxy.requests], [200] * 5)

    def test_chunked_request_is_held_whole(self) -> None:
        self.proxy.hold(request_matcher("POST"))
        sock = self.connect()
        head = b"POST /chunked HTTP/1.1\r\nHost: u\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"5\r\nhello\r\n")
        (held,) = self.proxy.wait_held(1, timeout=10)
        self.assertFalse(held.complete)
        sock.sendall(b"6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
        _wait_until(lambda: held.complete, "the last chunk arrived")
        self.assertEqual(self.upstream.paths(), [])
        self.proxy.release_held()
        self.assertEqual(_read_response(sock, bytearray()), (200, b"POST /chunked 11"))
        self.assertEqual(self.upstream.received, [("POST", "/chunked", b"hello world")])

    def test_release_after_the_client_left_still_delivers(self) -> None:
        self.proxy.hold(request_matcher("PUT"))
        gone = self.connect()
        gone.sendall(_request("PUT", "/closed", b"late"))
        reset = self.connect()
        reset.sendall(_request("PUT", "/reset", b"later"))
        first, second = self.proxy.wait_held(2, timeout=10)
        _wait_until(lambda: first.complete and second.complete, "both bodies arrived")
        gone.close()  # a FIN
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()  # a RST
        _wait_until(lambda: self.proxy.stats().open_connections <= 1, "the proxy saw the RST")
        self.proxy.pass_through()
        released = self.proxy.release_held()
        self.assertEqual([r.wait_answered(10) for r in released], [200, 200])
        self.assertEqual(sorted(self.upstream.paths()), ["/closed", "/reset"])
        _wait_until(lambda: self.proxy.stats().open_connections == 0, "everything closed")

    def test_a_client_gone_mid_body_abandons_its_request(self) -> None:
        self.proxy.hold(request_matcher("PUT"))
        sock = self.connect()
        sock.sendall(_request("PUT", "/partial", b"0123456789")[:-4])
        (held,) = self.proxy.wait_held(1, timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        _wait_until(lambda: self.proxy.stats().open_connections == 0, "the proxy saw the RST")
        self.assertEqual(self.proxy.release_held(), [held])
        self.assertTrue(held.abandoned)
        with self.assertRaisesRegex(RuntimeError, "never arrived whole"):
            held.wait_answered(1)
        self.assertEqual(self.upstream.paths(), [])

    def test_half_close_passes_on(self) -> None:
        sock = self.connect()
        sock.sendall(_request("GET", "/half"))
        sock.shutdown(socket.SHUT_WR)  # the client is done sending, still reading
        self.assertTrue(_read_to_eof(sock).endswith(b"GET /half 0"))
        _wait_until(lambda: self.proxy.stats().open_connections == 0, "the connection closed")

    def test_garbage_is_forwarded_and_survived(self) -> None:
        sock = self.connect()
        sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n\x00\xff")
        answer = _read_to_eof(sock)  # the server refuses it and closes: so does the proxy
        self.assertIn(b"400", answer.split(b"\r\n", 1)[0])
        sock.close()
        half = self.connect()
        half.sendall(b"GET /never-fin")  # a head cut short, then the client goes
        half.close()
        bad = self.connect()
        bad.sendall(b"PUT /x HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n")  # framing we do not follow
        bad.close()
        good = self.connect()
        good.sendall(_request("GET", "/fine"))
        self.assertEqual(_read_response(good, bytearray()), (200, b"GET /fine 0"))
        _wait_until(lambda: self.proxy.stats().open_connections == 1, "the others closed")

    def test_a_dead_upstream_resets_the_client(self) -> None:
        (port,) = s3servers.free_ports(1)
        proxy = BucketProxy("127.0.0.1", port).start()
        self.addCleanup(proxy.close)
        # The reset may come before connect() returns, on the send or on the read: no answer ever.
        with contextlib.suppress(ConnectionResetError):
            sock = self.connect_to(proxy.port)
            sock.sendall(_request("GET", "/"))
            self.assertEqual(sock.recv(100), b"")
        self.assertEqual(proxy.stats().upstream_connect_failures, 1)
        self.assertEqual(proxy.errors, [])

    def test_cut_resets_open_connections_and_new_ones(self) -> None:
        idle = self.connect()
        idle.sendall(_request("GET", "/before"))
        self.assertEqual(_read_response(idle, bytearray()), (200, b"GET /before 0"))
        self.proxy.cut()
        with self.assertRaises(ConnectionResetError):  # a RST, not a polite FIN
            idle.recv(100)
        # A new connection is accepted and reset at once (the port stays the proxy's).
        with contextlib.suppress(ConnectionResetError):
            late = self.connect()
            late.sendall(_request("GET", "/during"))
            self.assertEqual(late.recv(100), b"")
        self.proxy.pass_through()
        again = self.connect()
        again.sendall(_request("GET", "/after"))
        self.assertEqual(_read_response(again, bytearray()), (200, b"GET /after 0"))
        self.assertEqual(self.upstream.paths(), ["/before", "/after"])

    def test_blackhole_swallows_and_heal_resets(self) -> None:
        idle = self.connect()
        idle.sendall(_request("GET", "/before"))
        self.assertEqual(_read_response(idle, bytearray()), (200, b"GET /before 0"))
        self.proxy.blackhole()
        idle.sendall(_request("GET", "/during"))  # on a connection open before
        fresh = self.connect()  # accepted
        fresh.sendall(_request("PUT", "/swallowed", b"x"))
        _wait_until(lambda: self.proxy.stats().requests_dropped == 2, "both were read")
        dropped = [(e.path, e.dropped, e.status) for e in self.proxy.requests[1:]]
        self.assertEqual(sorted(dropped), [("/during", True, None), ("/swallowed", True, None)])
        self.assertEqual(self.upstream.paths(), ["/before"])
        self.proxy.pass_through()
        for sock in (idle, fresh):  # they lost bytes: reset at the heal
            with contextlib.suppress(ConnectionResetError):
                self.assertEqual(sock.recv(100), b"")
        again = self.connect()
        again.sendall(_request("GET", "/after"))
        self.assertEqual(_read_response(again, bytearray()), (200, b"GET /after 0"))

    def test_a_delivery_without_an_answer_is_lost(self) -> None:
        self.proxy.hold(request_matcher("PUT"))
        sock = self.connect()
        sock.sendall(_request("PUT", "/never-answered", b"x"))
        (held,) = self.proxy.wait_held(1, timeout=10)
        _wait_until(lambda: held.complete, "its body arrived")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a RST: its connection cannot carry the request any more
        _wait_until(lambda: self.proxy.stats().open_connections == 0, "the client left")
        self.upstream.stop()  # and the bucket is gone (refusing) when the late write is let go
        (released,) = self.proxy.release_held()
        with self.assertRaisesRegex(RuntimeError, "connection ended"):
            released.wait_answered(10)
        self.assertTrue(self.proxy.requests[0].lost)

    def test_close_is_clean(self) -> None:
        proxy = BucketProxy("127.0.0.1", self.upstream.port)
        port = proxy.port
        proxy.start()
        idle = self.connect_to(port)
        idle.sendall(_request("GET", "/idle"))
        self.assertEqual(_read_response(idle, bytearray()), (200, b"GET /idle 0"))
        proxy.hold(request_matcher("PUT"))
        held = self.connect_to(port)
        held.sendall(_request("PUT", "/held", b"x"))
        proxy.wait_held(1, timeout=10)
        proxy.close()
        self.assertEqual([t for t in threading.enumerate() if t.name == f"tcpproxy-{port}"], [])
        for sock in (idle, held):
            with contextlib.suppress(ConnectionResetError):
                self.assertEqual(sock.recv(100), b"")
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        proxy.close()  # idempotent
        with self.assertRaises(RuntimeError):
            proxy.cut()
        self.assertEqual(proxy.held, [])
        self.assertEqual(self.upstream.paths(), ["/idle"])  # a held request dies with the proxy
        BucketProxy("127.0.0.1", self.upstream.port).close()  # never started: closes too

    def test_no_busy_loop_in_any_waiting_state(self) -> None:
        self.proxy.hold(request_matcher("PUT"))
        blocked = self.connect()
        blocked.sendall(_request("PUT", "/held", b"x") + _request("GET", "/behind"))
        blocked.shutdown(socket.SHUT_WR)  # and the client has nothing more to say
        self.proxy.wait_held(1, timeout=10)
        idle = self.connect()
        idle.sendall(_request("GET", "/idle"))
        self.assertEqual(_read_response(idle, bytearray()), (200, b"GET /idle 0"))
        half = self.connect()
        half.sendall(_request("GET", "/half"))
        half.shutdown(socket.SHUT_WR)
        self.assertTrue(_read_to_eof(half).endswith(b"GET /half 0"))  # (the socket stays open)
        self.proxy.blackhole()
        swallowed = self.connect()
        swallowed.sendall(b"PUT /x HTTP/1.1\r\n")
        swallowed.shutdown(socket.SHUT_WR)
        _wait_until(lambda: self.proxy.stats().connections == 4, "all four accepted")
        time.sleep(0.1)  # let the proxy settle
        before = _cpu_seconds(self.proxy)
        time.sleep(1.0)
        # A spinning thread would burn most of that second (and a few percent on a loaded box).
        self.assertLess(_cpu_seconds(self.proxy) - before, 0.2)
        self.proxy.cut()
        before = _cpu_seconds(self.proxy)
        time.sleep(0.5)
        self.assertLess(_cpu_seconds(self.proxy) - before, 0.1)

    def connect_to(self, port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.addCleanup(sock.close)
        return sock


# -- the framing parser -----------------------------------------------------------------------------


def _message(method: str, body: bytes, chunks: list[int] | None) -> bytes:
    if chunks is None:
        return _request(method, "/m", body)
    out = f"{method} /m HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    rest = body
    for size in chunks:
        piece, rest = rest[:size], rest[size:]
        if piece:
            out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\n\r\n"


_MESSAGES = st.lists(
    st.tuples(
        st.sampled_from(["GET", "PUT", "POST"]),
        st.binary(max_size=40),
        st.none() | st.lists(st.integers(1, 15), min_size=1, max_size=4),
        st.booleans(),  # stray CRLF before it
    ),
    min_size=1,
    max_size=6,
)


class MessageStreamTests(TestCase):
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(messages=_MESSAGES, cuts=st.lists(st.integers(0, 2000), max_size=8))
    def test_splits_requests_byte_for_byte(
        self, messages: list[tuple[str, bytes, list[int] | None, bool]], cuts: list[int]
    ) -> None:
        wire = b"".join(
            (b"\r\n" if crlf else b"") + _message(m, b, c) for m, b, c, crlf in messages
        )
        stream = _MessageStream(_REQUEST_LINE, _REQUEST_FIRST)
        out, heads, ends = b"", [], 0
        points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
        for start, stop in itertools.pairwise(points):
            stream.feed(wire[start:stop])
            while (event := stream.pull()) is not None:
                kind, data = event
                out += data
                if kind is _Event.HEAD:
                    parsed = _parse_head(data, _REQUEST_LINE)
                    assert parsed is not None
                    heads.append(parsed[0].group(1).decode())
                    stream.set_framing(*_body_framing(parsed[1], request=True))
                elif kind is _Event.END:
                    ends += 1
                else:
                    self.assertIsNot(kind, _Event.OPAQUE)
        self.assertEqual(out, wire)
        self.assertEqual(stream.buffer, b"")
        self.assertEqual(heads, [m for m, _, _, _ in messages])
        self.assertEqual(ends, len(messages))

    def test_garbage_turns_opaque_at_once(self) -> None:
        stream = _MessageStream(_REQUEST_LINE, _REQUEST_FIRST)
        stream.feed(b"\x16\x03\x01 no blank line here")
        self.assertEqual(stream.pull(), (_Event.OPAQUE, b"\x16\x03\x01 no blank line here"))
        stream = _MessageStream(_REQUEST_LINE, _REQUEST_FIRST)
        stream.feed(b"NOT AN HTTP LINE\r\nmore")
        self.assertEqual(stream.pull(), (_Event.OPAQUE, b"NOT AN HTTP LINE\r\nmore"))
        stream = _MessageStream(_REQUEST_LINE, _REQUEST_FIRST)
        stream.feed(b"GET / HTTP/1.1\r\nHost")  # a head still arriving: wait for it
        self.assertIsNone(stream.pull())

    def test_framing(self) -> None:
        self.assertEqual(_body_framing({}, request=True), (_Framing.LENGTH, 0))
        self.assertEqual(_body_framing({}, request=False), (_Framing.UNTIL_CLOSE, 0))
        self.assertEqual(
            _body_framing({"content-length": "7, 7"}, request=True), (_Framing.LENGTH, 7)
        )
        self.assertEqual(
            _body_framing({"content-length": "7, 8"}, request=True), (_Framing.OPAQUE, 0)
        )
        self.assertEqual(
            _body_framing({"transfer-encoding": "gzip, chunked"}, request=True),
            (_Framing.CHUNKED, 0),
        )
        self.assertEqual(
            _body_framing({"transfer-encoding": "gzip"}, request=True), (_Framing.OPAQUE, 0)
        )

"""Big bodies read into the proxy's own buffers (lchat.proxy.bulk): every byte arrives, in order,
when uvloop could not send a read at once (a slow reader both ways: buffers lent and reused), and
the connections carry on with the next request afterwards."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks

from tests.test_proxy import HOST, BackendFactory, ProxyTestCase, sleep, take_request

PATTERN = random.Random(55).randbytes(1_000_003)  # a prime length: no read lines up with it
TOTAL = 24 * 1024 * 1024 + 12345


def pattern(offset: int, size: int) -> bytes:
    """``size`` bytes of the pattern from ``offset`` on (cheap: a few slices)."""
    out = bytearray()
    while size:
        start = offset % len(PATTERN)
        piece = PATTERN[start : start + size]
        out += piece
        offset += len(piece)
        size -= len(piece)
    return bytes(out)


EXPECTED = hashlib.sha256(pattern(0, TOTAL)).hexdigest()


class Pump:
    """Writes ``total`` bytes of the pattern as fast as its consumer allows."""

    def __init__(self, transport: Any, total: int, chunk: int = 100_003) -> None:
        self.transport = transport
        self.offset = 0
        self.total = total
        self.chunk = chunk
        self.paused = False
        transport.registerProducer(self, True)
        reactor.callLater(0, self._pump)

    def _pump(self) -> None:
        while not self.paused and self.offset < self.total:
            size = min(self.chunk, self.total - self.offset)
            self.transport.write(pattern(self.offset, size))
            self.offset += size
        if self.offset >= self.total:
            self.transport.unregisterProducer()

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        reactor.callLater(0, self._pump)

    def stopProducing(self) -> None:
        self.offset = self.total


@inlineCallbacks
def stutter(transport: Any, done: Any):
    """Stop and start reading a few times: writes towards it then stay partly unsent."""
    for _ in range(20):
        if done():
            return
        transport.pauseProducing()
        yield sleep(0.03)
        transport.resumeProducing()
        yield sleep(0.01)


class BulkTests(ProxyTestCase):
    @inlineCallbacks
    def test_download_arrives_whole_through_a_stuttering_client(self):
        def respond(conn: Any) -> None:
            while b"\r\n\r\n" in conn.buffer:
                head, _, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
                conn.buffer = bytearray(rest)
                if head.startswith(b"GET /big"):
                    conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % TOTAL)
                    Pump(conn.transport, TOTAL)
                else:
                    conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

        backend = BackendFactory(respond)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.connect()
        BUFFERS = self.factory.state.buffers
        lent, allocated = BUFFERS.lent_count, BUFFERS.allocated
        client.transport.write(b"GET /big HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: b"\r\n\r\n" in client.received, timeout=10)
        head_size = bytes(client.received).index(b"\r\n\r\n") + 4
        yield stutter(client.transport, lambda: len(client.received) >= head_size + TOTAL)
        yield self.until(lambda: len(client.received) >= head_size + TOTAL, timeout=60)
        body = bytes(client.received[head_size : head_size + TOTAL])
        self.assertEqual(hashlib.sha256(body).hexdigest(), EXPECTED)
        self.assertGreater(BUFFERS.lent_count, lent)  # the slow client made uvloop keep views
        self.assertLessEqual(BUFFERS.allocated - allocated, 8)  # lent buffers come back once sent
        # The same connections carry on.
        del client.received[:]
        client.transport.write(b"GET /small HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: client.received.endswith(b"hello"))
        self.assertEqual(backend.connections, 1)

    @inlineCallbacks
    def test_upload_arrives_whole_through_a_stuttering_space(self):
        state: dict[str, Any] = {"conn": None, "received": 0, "body": hashlib.sha256()}

        def respond(conn: Any) -> None:
            if state["conn"] is None:
                state["conn"] = conn
                _, _, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
                conn.buffer = bytearray(rest)
                reactor.callLater(0, stutter, conn.transport, lambda: state["received"] >= TOTAL)
            if state["received"] < TOTAL:
                take = bytes(conn.buffer[: TOTAL - state["received"]])
                del conn.buffer[: len(take)]
                state["received"] += len(take)
                state["body"].update(take)
                if state["received"] >= TOTAL:
                    conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndone")
            while b"\r\n\r\n" in conn.buffer:
                _, _, rest = bytes(conn.buffer).partition(b"\r\n\r\n")
                conn.buffer = bytearray(rest)
                conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

        backend = BackendFactory(respond)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.connect()
        BUFFERS = self.factory.state.buffers
        lent, allocated = BUFFERS.lent_count, BUFFERS.allocated
        client.transport.write(
            b"POST /up HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (HOST.encode(), TOTAL)
        )
        Pump(client.transport, TOTAL)
        yield self.until(lambda: client.received.endswith(b"done"), timeout=60)
        self.assertEqual(state["received"], TOTAL)
        self.assertEqual(state["body"].hexdigest(), EXPECTED)
        self.assertGreater(BUFFERS.lent_count, lent)  # the slow space made uvloop keep views
        self.assertLessEqual(BUFFERS.allocated - allocated, 8)  # lent buffers come back once sent
        del client.received[:]
        client.transport.write(b"GET /small HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
        yield self.until(lambda: client.received.endswith(b"hello"))
        self.assertEqual(backend.connections, 1)


class BulkTLSTests(BulkTests):
    secure = True


def echo_bodies(conn: Any) -> None:
    """Answer each ``Content-Length`` request with its own body; the backend parses as it goes."""
    while (request := take_request(conn)) is not None:
        _, body = request
        conn.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        conn.transport.write(body)


class BulkBoundaryTests(ProxyTestCase):
    """Bodies either side of the bulk threshold, each followed at once by the next request in the
    same write (pipelined): the last read of a bulk body carries the next head, which must go the
    general way; every body comes back whole, in order, on one client and one space connection."""

    @inlineCallbacks
    def test_bodies_around_the_threshold_echo_back_whole_and_in_order(self):
        from lchat.proxy.bulk import MIN_BULK

        sizes = [MIN_BULK - 1, MIN_BULK, MIN_BULK + 1, MIN_BULK + 65_537, 3 * MIN_BULK + 7, 5]
        backend = BackendFactory(echo_bodies)
        yield self.backend(backend)
        yield self.proxy()
        client = yield self.connect()
        wire = bytearray()
        bodies = []
        for i, size in enumerate(sizes):
            body = pattern(i * 7919, size)
            bodies.append(body)
            wire += b"POST /echo HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (
                HOST.encode(),
                size,
            )
            wire += body
        client.transport.write(bytes(wire))
        yield self.until(
            lambda: (
                client.received.count(b"HTTP/1.1 200 OK") == len(sizes)
                and client.received.endswith(bodies[-1])
            ),
            timeout=60,
        )
        got = bytes(client.received)
        for body in bodies:
            head_end = got.index(b"\r\n\r\n") + 4
            head = got[:head_end]
            self.assertIn(b"Content-Length: %d\r\n" % len(body), head)
            self.assertEqual(
                hashlib.sha256(got[head_end : head_end + len(body)]).hexdigest(),
                hashlib.sha256(body).hexdigest(),
            )
            got = got[head_end + len(body) :]
        self.assertEqual(got, b"")
        self.assertEqual(backend.connections, 1)


class BulkBoundaryTLSTests(BulkBoundaryTests):
    secure = True

"""lchat.unixhttp against real servers on unix sockets (in-process twisted.web and raw sockets)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.trial import unittest
from twisted.web import resource, server

from lchat import unixhttp
from lchat.reactors import installed
from lchat.unixhttp import Response, ResponseTooLarge, UnixHTTPError

reactor = installed()


class _Version(resource.Resource):
    isLeaf = True

    def render_GET(self, request):
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"X-Seen-Host", request.getHeader(b"host") or b"")
        request.setHeader(b"X-Seen-Auth", request.getHeader(b"authorization") or b"")
        if request.path == b"/big":
            return b"x" * (unixhttp.MAX_BODY + 1)
        if request.path == b"/missing":
            request.setResponseCode(404)
            return b"no"
        return b'{"version": "1", "build": "t"}'

    def render_POST(self, request):
        return b"echo:" + request.content.read()


class _Silent(Protocol):
    """Accepts and never answers."""


class UnixHTTPTests(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="uh", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _serve(self, factory) -> str:
        path = os.path.join(self.dir, "s.sock")
        port = reactor.listenUNIX(path, factory)
        self.addCleanup(port.stopListening)
        return path

    def _site(self) -> str:
        site = server.Site(_Version())
        site.noisy = False
        return self._serve(site)

    async def test_ok_with_body_and_headers(self):
        path = self._site()
        resp = await unixhttp.request(
            reactor,
            path,
            "GET",
            "/api/version",
            host="chat-a.example.com",
            headers={"Authorization": "Bearer t0k"},
        )
        self.assertEqual(resp.status, 200)
        self.assertEqual(resp.body, b'{"version": "1", "build": "t"}')
        self.assertEqual(resp.headers["content-type"], "application/json")
        self.assertEqual(resp.headers["x-seen-host"], "chat-a.example.com")
        self.assertEqual(resp.headers["x-seen-auth"], "Bearer t0k")

    async def test_non_200_is_a_response_not_an_error(self):
        resp = await unixhttp.request(reactor, self._site(), "GET", "/missing")
        self.assertEqual((resp.status, resp.body), (404, b"no"))

    def test_post_body(self):
        d = Deferred.fromCoroutine(
            unixhttp.request(reactor, self._site(), "POST", "/x", body=b"hello")
        )
        d.addCallback(lambda r: self.assertEqual((r.status, r.body), (200, b"echo:hello")))
        return d

    async def test_body_over_cap_raises(self):
        with self.assertRaises(ResponseTooLarge) as cm:
            await unixhttp.request(reactor, self._site(), "GET", "/big")
        self.assertIn("exceeds", str(cm.exception))

    def _raw(self, answer: bytes) -> str:
        """A server that writes ``answer`` verbatim once it sees a request, then closes."""

        class _Raw(Protocol):
            def dataReceived(self, data):
                assert self.transport is not None
                self.transport.write(answer)
                self.transport.loseConnection()

        return self._serve(Factory.forProtocol(_Raw))

    async def test_body_without_length_read_to_close(self):
        path = self._raw(b"HTTP/1.0 200 OK\r\nX-A: 1\r\n\r\nhello")
        resp = await unixhttp.request(reactor, path, "GET", "/api/version")
        self.assertEqual((resp.status, resp.headers["x-a"], resp.body), (200, "1", b"hello"))

    async def test_streamed_body_over_cap_raises(self):
        # No Content-Length, so the cap is enforced while reading, not from the header.
        path = self._raw(b"HTTP/1.0 200 OK\r\n\r\n" + b"y" * (unixhttp.MAX_BODY + 10))
        with self.assertRaises(ResponseTooLarge):
            await unixhttp.request(reactor, path, "GET", "/api/version")

    async def test_small_cap(self):
        with self.assertRaises(ResponseTooLarge):
            await unixhttp.request(reactor, self._site(), "GET", "/api/version", max_body=4)

    async def test_missing_socket(self):
        path = os.path.join(self.dir, "nothing.sock")
        with self.assertRaises(UnixHTTPError) as cm:
            await unixhttp.request(reactor, path, "GET", "/api/version")
        self.assertEqual(cm.exception.socket_path, path)
        self.assertIn("does not exist", cm.exception.reason)

    async def test_connection_refused(self):
        # A bound but not listening unix socket: the file exists, connect() is refused.
        path = os.path.join(self.dir, "dead.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(s.close)
        s.bind(path)
        with self.assertRaises(UnixHTTPError) as cm:
            await unixhttp.request(reactor, path, "GET", "/api/version")
        self.assertIn("refused", cm.exception.reason)

    async def test_timeout_when_server_never_answers(self):
        path = self._serve(Factory.forProtocol(_Silent))
        start = reactor.seconds()
        with self.assertRaises(UnixHTTPError) as cm:
            await unixhttp.request(reactor, path, "GET", "/api/version", timeout=0.3)
        self.assertIn("no response within 0.3s", str(cm.exception))
        self.assertLess(reactor.seconds() - start, 3)

    async def test_server_hangs_up_without_answer(self):
        class _HangUp(Protocol):
            def dataReceived(self, data):
                assert self.transport is not None
                self.transport.loseConnection()

        path = self._serve(Factory.forProtocol(_HangUp))
        with self.assertRaises(UnixHTTPError) as cm:
            await unixhttp.request(reactor, path, "GET", "/api/version")
        self.assertIn("without a response", cm.exception.reason)

    def test_response_is_frozen_value(self):
        r = Response(status=200, headers={"a": "b"}, body=b"")
        self.assertEqual(r, Response(status=200, headers={"a": "b"}, body=b""))

    def test_relative_path_rejected(self):
        d = Deferred.fromCoroutine(unixhttp.request(reactor, "/nope", "GET", "api"))
        return self.assertFailure(d, ValueError)


class FakeTimeTests(unittest.TestCase):
    """Timeouts and cancellation while still connecting (a connect that never completes)."""

    def test_timeout_while_connecting(self):
        clock = MemoryReactorClock()
        d = Deferred.fromCoroutine(
            unixhttp.request(clock, "/x.sock", "GET", "/api/version", timeout=2)
        )
        clock.advance(1.9)
        self.assertNoResult(d)
        clock.advance(0.2)
        f = self.failureResultOf(d, UnixHTTPError)
        self.assertEqual(f.value.reason, "no response within 2s")
        self.assertFalse(clock.getDelayedCalls())

    def test_cancel_propagates(self):
        clock = MemoryReactorClock()
        d = Deferred.fromCoroutine(unixhttp.request(clock, "/x.sock", "GET", "/api/version"))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertFalse(clock.getDelayedCalls())
        self.assertTrue(clock.connectors[0].stoppedConnecting)

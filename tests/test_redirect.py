"""The port-80 listener: a real Site on 127.0.0.1 and raw HTTP requests (so Host can be anything)."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from lchat.redirect import RedirectToHTTPS, _target

reactor: Any = _reactor


class _Raw(Protocol):
    def __init__(self, request: bytes) -> None:
        self.request = request
        self.data = b""
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self.done.callback(self.data)


class _Challenge(Resource):
    """What the certificate issue will plug in: answers with the token it was asked for."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"token:" + b"/".join(request.postpath or [])


class RedirectTests(TestCase):
    @inlineCallbacks
    def serve(self, root: RedirectToHTTPS) -> Any:
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Site(root))
        self.addCleanup(port.stopListening)
        return port.getHost().port

    @inlineCallbacks
    def ask(
        self, port: int, target: bytes, host: bytes | None = b"chat.example.com", method=b"GET"
    ) -> Any:
        head = method + b" " + target + b" HTTP/1.1\r\n"
        if host is not None:
            head += b"Host: " + host + b"\r\n"
        client = _Raw(head + b"Connection: close\r\n\r\n")
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        data = yield client.done
        status_line, _, rest = data.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        fields = dict(
            (k.strip().lower(), v.strip())
            for k, _, v in (line.partition(b":") for line in headers.split(b"\r\n"))
        )
        return int(status_line.split(b" ")[1]), fields, body

    @inlineCallbacks
    def test_everything_moves_to_https_with_path_and_query(self) -> Any:
        port = yield self.serve(RedirectToHTTPS())
        cases = {
            (b"/", b"chat.example.com"): b"https://chat.example.com/",
            (b"/api/rooms?after=3&x=%20y", b"Chat.Example.COM:80"): (
                b"https://chat.example.com/api/rooms?after=3&x=%20y"
            ),
            (
                b"/.well-known/other",
                b"chat.example.com",
            ): b"https://chat.example.com/.well-known/other",
            (b"/.well-known/acme-challenge", b"chat.example.com"): (
                b"https://chat.example.com/.well-known/acme-challenge"
            ),
            (
                b"http://chat.example.com/p?q=1",
                b"chat.example.com",
            ): b"https://chat.example.com/p?q=1",
            (b"/x", b"127.0.0.1:8080"): b"https://127.0.0.1/x",
        }
        for (target, host), location in cases.items():
            status, headers, _ = yield self.ask(port, target, host)
            self.assertEqual((status, headers.get(b"location")), (301, location), target)
        status, headers, _ = yield self.ask(port, b"/form", method=b"POST")
        self.assertEqual((status, headers[b"location"]), (301, b"https://chat.example.com/form"))

    @inlineCallbacks
    def test_public_https_port_other_than_443_is_kept(self) -> Any:
        port = yield self.serve(RedirectToHTTPS(https_port=8443))
        status, headers, _ = yield self.ask(port, b"/a?b", b"demo.localhost:8080")
        self.assertEqual((status, headers[b"location"]), (301, b"https://demo.localhost:8443/a?b"))
        port = yield self.serve(RedirectToHTTPS(https_port=443))
        status, headers, _ = yield self.ask(port, b"/a", b"demo.localhost:8080")
        self.assertEqual(headers[b"location"], b"https://demo.localhost/a")

    @inlineCallbacks
    def test_acme_challenges_go_to_the_hook(self) -> Any:
        port = yield self.serve(RedirectToHTTPS(acme_challenge=_Challenge()))
        status, headers, body = yield self.ask(port, b"/.well-known/acme-challenge/tok-123")
        self.assertEqual((status, body), (200, b"token:tok-123"))
        self.assertNotIn(b"location", headers)

    @inlineCallbacks
    def test_acme_challenges_are_404_without_a_hook(self) -> Any:
        port = yield self.serve(RedirectToHTTPS())
        status, headers, _ = yield self.ask(port, b"/.well-known/acme-challenge/tok-123")
        self.assertEqual(status, 404)
        self.assertNotIn(b"location", headers)

    @inlineCallbacks
    def test_missing_or_malformed_host_is_400(self) -> Any:
        port = yield self.serve(RedirectToHTTPS())
        for host in (
            None,
            b"",
            b"a b.example.com",
            b"evil.com/x",
            b"chat.example.com:99999",
            b"\xff",
        ):
            status, headers, _ = yield self.ask(port, b"/", host)
            self.assertEqual(status, 400, host)
            self.assertNotIn(b"location", headers)

    def test_https_port_must_be_a_port(self) -> None:
        self.assertRaises(ValueError, RedirectToHTTPS, https_port=0)
        self.assertRaises(ValueError, RedirectToHTTPS, https_port=70000)


class TargetTests(TestCase):
    def test_target_is_path_and_query_in_printable_ascii(self) -> None:
        self.assertEqual(_target(b"/a?b=1"), b"/a?b=1")
        self.assertEqual(
            _target(b"/caf\xc3\xa9 x"), b"/caf%C3%A9%20x"
        )  # Twisted refuses these first
        self.assertEqual(_target(b"https://h.example.com/p?q"), b"/p?q")
        self.assertEqual(_target(b"http://h.example.com"), b"/")
        self.assertEqual(_target(b"*"), b"/")
        self.assertEqual(_target(b"//other.example.com/x"), b"//other.example.com/x")  # a path here

"""lchat.proxy.exchange's pure functions, without a connection: what a parsed head is checked
against and read as (validate), and the heads written upstream and to the client."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from lchat.proxy.exchange import (
    Exchange,
    Reject,
    client_head,
    hop_origin,
    upstream_head,
    validate,
)
from lchat.proxy.http import REFUSED, Header
from lchat.router import LocalSocket, RemotePeer, RequestHead


def parsed(headers: list[Header], method: bytes = b"GET", version: str = "1.1") -> Exchange:
    """An exchange as httptools' callbacks leave it at the end of a head."""
    ex = Exchange(0.0, method)
    ex.url += b"/p?q=1"
    ex.version = version
    ex.headers = headers
    return ex


def host(raw: bytes) -> str:
    if raw != b"a.test":
        raise Reject(400, "malformed Host header")
    return "a.test"


def check(ex: Exchange, max_body: int = 0) -> RequestHead:
    return validate(ex, host, "10.0.0.1", True, max_body)


class ValidateTests(SynchronousTestCase):
    def refused(self, ex: Exchange, status: int, max_body: int = 0) -> None:
        with self.assertRaises(Reject) as caught:
            check(ex, max_body)
        self.assertEqual(caught.exception.status, status)

    def test_what_goes_upstream_and_what_is_read(self) -> None:
        ex = parsed(
            [
                (b"Host", b"a.test"),
                (b"Accept", b"*/*"),
                (b"Connection", b"keep-alive"),
                (b"X-Forwarded-For", b"1.2.3.4"),
                (b"Proxy-Authorization", b"x"),
                (b"X_Lchat_Sidecar", b"1"),
                (b"X-Lchat-Sidecar", b"1"),
                (b"Content-Length", b"5"),
            ],
            method=b"POST",
        )
        head = check(ex)
        self.assertEqual(
            head, RequestHead(b"POST", b"/p?q=1", "a.test", "10.0.0.1", True, sidecar=True)
        )
        self.assertEqual(ex.upstream_lines, b"Host: a.test\r\nAccept: */*\r\n")
        self.assertEqual((ex.length, ex.chunked, ex.forwarded_for), (5, False, [b"1.2.3.4"]))

    def test_refusals(self) -> None:
        one = [(b"Host", b"a.test")]
        self.refused(parsed(one, method=b"CONNECT"), 405)
        self.refused(parsed(one, version="2.0"), 505)
        self.refused(parsed(one * 2), 400)
        self.refused(parsed([(b"Host", b"b.test")]), 400)
        self.refused(parsed([*one, (b"Transfer-Encoding", b"gzip")]), 501)
        self.refused(parsed([*one, (b"Transfer-Encoding", b"chunked")], version="1.0"), 400)
        self.refused(parsed([*one, (b"Content-Length", b"1"), (b"Content-Length", b"2")]), 400)
        self.refused(parsed([*one, (b"Expect", b"later")]), 417)
        self.refused(parsed([*one, (b"Connection", b"host")]), 400)
        self.refused(parsed([*one, (b"Content-Length", b"10")]), 413, max_body=9)
        upgrade = [*one, (b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")]
        self.refused(parsed([*upgrade, (b"Content-Length", b"1")]), 400)
        self.assertTrue(check(parsed(upgrade)).upgrade)


class HeadTests(SynchronousTestCase):
    def test_upstream_heads(self) -> None:
        ex = parsed([(b"Host", b"a.test")])
        ex.head = check(ex)
        ex.target = LocalSocket("a.test", "/run/a.sock")
        self.assertEqual(
            upstream_head(ex, b"10.0.0.1", b"https"),
            b"GET /p?q=1 HTTP/1.1\r\nHost: a.test\r\n"
            b"X-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: https\r\n\r\n",
        )
        ex = parsed([(b"Host", b"a.test"), (b"X-Forwarded-For", b"1.2.3.4")], method=b"POST")
        ex.head = check(ex)
        ex.chunked = True
        ex.target = RemotePeer("a.test", "10.0.0.2", 443, "a.test", ((b"X-Mesh", b"1"),))
        self.assertEqual(
            upstream_head(ex, b"10.0.0.1", b"https"),
            b"POST /p?q=1 HTTP/1.1\r\nHost: a.test\r\n"
            b"X-Forwarded-For: 1.2.3.4, 10.0.0.1\r\nX-Forwarded-Proto: https\r\n"
            b"X-Mesh: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        )

    def test_client_heads(self) -> None:
        space = [(b"Content-Type", b"text/plain"), (b"X-Lchat-Refused", b"stopping")]
        ex = parsed([])
        self.assertEqual(
            client_head(ex, 200, b"OK", space, None, ((b"X-Lchat-Wake", b"1"),)),
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Lchat-Wake: 1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
        )
        self.assertEqual((ex.response_chunked, ex.close_after), (True, False))
        ex = parsed([], version="1.0")
        self.assertEqual(
            client_head(ex, 200, b"OK", space, None, ()),
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n",
        )
        self.assertEqual((ex.response_chunked, ex.close_after), (False, True))
        ex = parsed([], version="1.0")
        self.assertEqual(
            client_head(ex, 204, b"No Content", [], 0, ()),
            b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n",
        )

    def test_client_head_keeps_only_what_it_is_told(self) -> None:
        """A hop target's answer keeps control's drain refusal (keep); the other internal
        headers are dropped all the same, and without keep every one is."""
        space = [
            (b"X-Lchat-Refused", b"stopping"),
            (b"X-Lchat-Sidecar", b"1"),
            (b"X-Lchat-Mesh-Forwarded", b"x"),
        ]
        self.assertEqual(
            client_head(
                parsed([]), 503, b"Service Unavailable", space, 0, (), frozenset({REFUSED})
            ),
            b"HTTP/1.1 503 Service Unavailable\r\nX-Lchat-Refused: stopping\r\n"
            b"Content-Length: 0\r\n\r\n",
        )
        self.assertEqual(
            client_head(parsed([]), 503, b"Service Unavailable", space, 0, ()),
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        )

    def test_upstream_head_with_a_local_sockets_added_headers(self) -> None:
        """A hop target's add_headers follow the forwarding headers, as a peer's do: the common
        head's shortcut (plain_upstream_head) is not taken for it."""
        ex = parsed([(b"Host", b"a.test")])
        ex.head = check(ex)
        added = ((b"X-Lchat-Sidecar", b"1"), (b"X-Lchat-Mesh-Forwarded", b"m"))
        ex.target = LocalSocket("a.test", "/run/workers/hop.sock", kind="hop", add_headers=added)
        self.assertEqual(
            upstream_head(ex, b"10.0.0.1", b"http"),
            b"GET /p?q=1 HTTP/1.1\r\nHost: a.test\r\n"
            b"X-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: http\r\n"
            b"X-Lchat-Sidecar: 1\r\nX-Lchat-Mesh-Forwarded: m\r\n\r\n",
        )
        # Without added headers a hop target's head is the common one, byte for byte.
        ex.target = LocalSocket("a.test", "/run/workers/hop.sock", kind="hop")
        plain = upstream_head(ex, b"10.0.0.1", b"http")
        ex.target = LocalSocket("a.test", "/run/a.sock")
        self.assertEqual(plain, upstream_head(ex, b"10.0.0.1", b"http"))


def hop_exchange(headers: list[Header]) -> tuple[Exchange, RequestHead]:
    """A request as the control process's hop socket reads it (its peer: "unix")."""
    ex = parsed([(b"Host", b"a.test"), *headers])
    head = validate(ex, host, "unix", False, 0)
    ex.head = head
    ex.target = LocalSocket("a.test", "/run/a.sock")
    return ex, head


class HopOriginTests(SynchronousTestCase):
    def test_the_workers_client_and_scheme(self) -> None:
        """The last X-Forwarded-For element is the client, X-Forwarded-Proto the scheme; the
        element is taken out, so that the head written on to the space is the one the worker
        would have written to it (the client's own X-Forwarded-For values before it)."""
        cases = [
            ([], b"10.0.0.1"),  # the client sent none
            ([b"1.2.3.4"], b"1.2.3.4, 10.0.0.1"),
            ([b"1.2.3.4", b"5.6.7.8, 9.9.9.9"], b"1.2.3.4, 5.6.7.8, 9.9.9.9, 10.0.0.1"),
            ([b""], b", 10.0.0.1"),  # an empty value of the client's
            ([b"a,"], b"a,, 10.0.0.1"),
        ]
        for own, written in cases:
            for scheme in (b"http", b"https"):
                with self.subTest(own=own, scheme=scheme):
                    ex, head = hop_exchange(
                        [(b"X-Forwarded-For", written), (b"X-Forwarded-Proto", scheme)]
                    )
                    head, origin = hop_origin(ex, head)
                    self.assertEqual(origin, (b"10.0.0.1", scheme))
                    self.assertEqual((head.client, head.secure), ("10.0.0.1", scheme == b"https"))
                    ex.head = head
                    ex.target = RemotePeer("a.test", "10.0.0.2", 443, "a.test")  # (general head)
                    direct = parsed([(b"Host", b"a.test"), *((b"X-Forwarded-For", v) for v in own)])
                    direct.head = validate(direct, host, "10.0.0.1", scheme == b"https", 0)
                    direct.target = ex.target
                    self.assertEqual(
                        upstream_head(ex, *origin), upstream_head(direct, b"10.0.0.1", scheme)
                    )

    def test_refused_without_the_forwarding_headers(self) -> None:
        for headers in (
            [(b"X-Forwarded-Proto", b"https")],
            [(b"X-Forwarded-For", b"10.0.0.1")],
            [(b"X-Forwarded-For", b"10.0.0.1"), (b"X-Forwarded-Proto", b"gopher")],
            [(b"X-Forwarded-For", b"1.2.3.4, "), (b"X-Forwarded-Proto", b"http")],
        ):
            with self.subTest(headers=headers):
                ex, head = hop_exchange(headers)
                with self.assertRaises(Reject) as caught:
                    hop_origin(ex, head)
                self.assertEqual(caught.exception.status, 400)

"""The forwarded marker: only a peer holding the mesh token can make a box serve locally."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from lchat.mesh import forward

TOKEN = "s3cret-token"
HOST = "a.mesh.example"


class MarkerTests(TestCase):
    def test_a_fresh_marker_for_this_host_authenticates(self) -> None:
        value = forward.marker(TOKEN, HOST, now=lambda: 1_000_000.0)
        self.assertTrue(value.startswith(b"v1 1000000 "))
        self.assertTrue(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_030.0))

    def test_wrong_token_other_host_or_stale_is_refused(self) -> None:
        value = forward.marker(TOKEN, HOST, now=lambda: 1_000_000.0)
        at = lambda: 1_000_000.0  # noqa: E731
        self.assertFalse(forward.authentic(value, "other-token", HOST, now=at))
        self.assertFalse(forward.authentic(value, TOKEN, "b.mesh.example", now=at))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0 + 121))
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0 - 121))
        self.assertFalse(forward.authentic(value, "", HOST, now=at))  # no token: never

    def test_garbage_is_refused(self) -> None:
        for value in (
            None,
            b"",
            b"1",
            b"v1",
            b"v2 1000000 " + b"0" * 64,
            b"v1 notanumber " + b"0" * 64,
            b"v1 1000000 " + b"0" * 64,
            b"v1 1000000 zz",
            b"\xff\xfe",
            b"v1 1000000 " + b"a" * 500,
        ):
            self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0))

    @given(st.binary(max_size=300))
    def test_no_random_value_authenticates(self, value: bytes) -> None:
        self.assertFalse(forward.authentic(value, TOKEN, HOST, now=lambda: 1_000_000.0))


class PeerTargetTests(TestCase):
    def test_https_peer_is_pinned_and_verified_against_the_space(self) -> None:
        target = forward.peer_target("https://box-b.example.net:8443", HOST, TOKEN)
        self.assertEqual(
            (target.address, target.port, target.server_name, target.tls),
            ("box-b.example.net", 8443, HOST, True),
        )
        ((name, value),) = target.add_headers
        self.assertEqual(name, forward.HEADER)
        self.assertTrue(forward.authentic(value, TOKEN, HOST))

    def test_default_ports_and_plain_http(self) -> None:
        self.assertEqual(forward.peer_target("https://10.0.0.5", HOST, TOKEN).port, 443)
        plain = forward.peer_target("http://10.0.0.5", HOST, TOKEN)
        self.assertEqual((plain.port, plain.tls), (80, False))

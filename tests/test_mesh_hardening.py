"""Issue 29, "The mesh token must not reach beyond the mesh": what a peer's route push may name
(``lives_at``: members only, HTTPS; hosts: the mesh's domains only), failed authentication on the
public port rate-limited per client, and a mesh token too short to start on.

The mesh API is the real one (lchat.mesh.api.mesh_site) on 127.0.0.1, its registry and env files
on disk, as in tests.test_mesh_api; time is a task.Clock where it matters.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread

from lchat.config import ConfigError
from lchat.mesh import client, tokens
from tests.test_config import MESH_OK, Base
from tests.test_mesh_api import (
    HOST,
    TOKEN,
    APITestCase,
    Box,
    Served,
    payload,
    request_bytes,
)

MEMBER = "https://box-2.example.net"


def elsewhere(**changes: Any) -> dict[str, Any]:
    """The lives-elsewhere shape (``lchat hibernate --off`` on the box at ``lives_at``)."""
    body = payload(hibernate=False, env={}, lives_at=MEMBER)
    body.update(changes)
    return body


def post(body: dict[str, Any], *, token: str = TOKEN, extra: tuple[str, ...] = ()) -> bytes:
    return request_bytes("POST", client.ROUTE_PATH, json.dumps(body).encode(), token=token,
                         extra=extra)  # fmt: skip


def limited() -> float:
    return REGISTRY.get_sample_value("lchat_mesh_auth_limited_total") or 0.0


class LivesAtTests(APITestCase):
    """On an HTTPS mesh, ``lives_at`` must be an authenticated member's URL over HTTPS."""

    def setUp(self) -> None:
        super().setUp()
        self.box = Box(self.root, "box-https", LCHAT_MESH_SELF="https://box-1.example.net")
        self.served = Served(self, self.box, members=lambda url: url == MEMBER)

    @inlineCallbacks
    def test_a_member_over_https_is_accepted(self) -> Any:
        code, answer = yield self.raw(post(elsewhere()))
        self.assertEqual((code, answer["result"]), (201, "created"), answer)
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual(route.lives_at, MEMBER)

    @inlineCallbacks
    def test_plain_http_is_refused(self) -> Any:
        """A cleartext diversion of the space's traffic, even to a member's host."""
        for url in ("http://box-2.example.net", "http://box-2.example.net:443"):
            yield self.assertRefused(post(elsewhere(lives_at=url)), 400, "must be https")

    @inlineCallbacks
    def test_a_url_that_is_no_member_is_refused(self) -> Any:
        """SSRF into the box's network (instance metadata, a service on loopback), or a
        listener of the token holder's own: never a member."""
        for url in (
            "https://169.254.169.254",
            "https://127.0.0.1:2019",
            "https://box-3.example.net",
            "https://box-2.example.net:8443",  # the member's host, another port
        ):
            yield self.assertRefused(post(elsewhere(lives_at=url)), 400, "not a member")

    @inlineCallbacks
    def test_without_a_membership_no_lives_at_is_accepted(self) -> Any:
        self.served = Served(self, self.box)  # (an API given no membership)
        yield self.assertRefused(post(elsewhere()), 400, "not a member")


class ScopeTests(APITestCase):
    @inlineCallbacks
    def test_a_home_region_does_not_bring_in_names_outside_the_mesh_domains(self) -> Any:
        """This box's own region, but a name outside LCHAT_MESH_DOMAINS: refused (the box would
        serve it and order a certificate for it)."""
        for host in ("x.elsewhere.org", "chat.example.com.evil.net", "evil-chat.example.com"):
            yield self.assertRefused(
                post(payload(host=host, home_region="ie")), 400, "not in this box's mesh scope"
            )

    @inlineCallbacks
    def test_a_home_region_still_places_names_deeper_under_the_domains(self) -> Any:
        code, answer = yield self.raw(post(payload(host="x.y.chat.example.com", home_region="ie")))
        self.assertEqual((code, answer["result"]), (201, "created"), answer)


class AuthLimitTests(APITestCase):
    """Failed authentication, per client address (the last X-Forwarded-For entry, which the
    box's proxy appends): a burst, then 429 with Retry-After whatever the token."""

    def setUp(self) -> None:
        super().setUp()
        self.clock = Clock()
        self.served = Served(self, self.box, clock=self.clock.seconds)

    def call(self, token: str, client_ip: str) -> Any:
        # What the proxy sends: the client's own values first, then the address it saw.
        extra = (f"X-Forwarded-For: 10.9.9.9, {client_ip}",)
        return self.raw(request_bytes("GET", client.ROUTES_PATH, token=token, extra=extra))

    @inlineCallbacks
    def test_failures_are_limited_per_client(self) -> Any:
        before = limited()
        for _ in range(tokens.AUTH_FAILURES_BURST):
            code, _ = yield self.call("wrong-" + "w" * 30, "203.0.113.5")
            self.assertEqual(code, 401)
        code, body = yield self.call("wrong-" + "w" * 30, "203.0.113.5")
        self.assertEqual(code, 429, body)
        self.assertIn("try again in 6s", body["error"])
        # Even the right token: a guesser learns nothing once limited.
        code, _ = yield self.call(TOKEN, "203.0.113.5")
        self.assertEqual(code, 429)
        self.assertEqual(limited(), before + 2)
        # Another client (its own X-Forwarded-For value is not what counts) is not limited.
        code, _ = yield self.call(TOKEN, "203.0.113.6")
        self.assertEqual(code, 200)
        # One more try every AUTH_FAILURE_EVERY seconds.
        self.clock.advance(tokens.AUTH_FAILURE_EVERY)
        code, _ = yield self.call(TOKEN, "203.0.113.5")
        self.assertEqual(code, 200)

    @inlineCallbacks
    def test_the_answer_carries_retry_after(self) -> Any:
        for _ in range(tokens.AUTH_FAILURES_BURST):
            yield self.call("", "203.0.113.7")
        status, headers = yield self.head_of(
            request_bytes("GET", client.ROUTES_PATH, extra=("X-Forwarded-For: 203.0.113.7",))
        )
        self.assertEqual(status, 429)
        self.assertEqual(headers.get("retry-after"), "6")

    def head_of(self, data: bytes) -> Any:
        def run() -> tuple[int, dict[str, str]]:
            with socket.create_connection(("127.0.0.1", self.served.number), timeout=10) as s:
                s.sendall(data)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
            head = got.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            fields = dict(line.split(": ", 1) for line in head[1:])
            return int(head[0].split(" ")[1]), {k.lower(): v for k, v in fields.items()}

        return deferToThread(run)

    def test_the_limiter_forgets_the_least_recent_client_first(self) -> None:
        clock = Clock()
        limiter = tokens.AuthLimiter(clock.seconds, burst=1, every=10.0, clients=2)
        for ip in ("a", "b", "c"):
            limiter.failed(ip)
        self.assertIsNone(limiter.retry_after("a"))  # forgotten: a full bucket again
        self.assertEqual(limiter.retry_after("c"), 10)
        clock.advance(9.5)
        self.assertEqual(limiter.retry_after("c"), 1)
        clock.advance(0.5)
        self.assertIsNone(limiter.retry_after("c"))


class TokenStrengthTests(Base):
    def test_a_short_mesh_token_refuses_to_start(self) -> None:
        for name in ("LCHAT_MESH_TOKEN", "LCHAT_MESH_TOKEN_ACCEPT"):
            short = "s" * 31
            with self.assertRaises(ConfigError) as e:
                self.load({**MESH_OK, name: short})
            message = str(e.exception)
            self.assertIn(f"{name} is 31 characters: at least 32", message)
            self.assertNotIn(short, message)  # never the value itself
        cfg = self.load({**MESH_OK, "LCHAT_MESH_TOKEN": "s" * 32})
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.token, "s" * 32)

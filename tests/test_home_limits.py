"""Home's rate limits on a ``task.Clock`` (lchat/home/limits.py), the client address they key on,
their settings (lchat/home/config.py), and the RS256 key bound (lchat/home/passkeys.py).
Issue 29, items 5 and 9; the processes under abuse are tests/test_home_abuse.py."""

from __future__ import annotations

import os
from typing import Any, cast

from prometheus_client import REGISTRY
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.interfaces import IAddress
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from lchat.config import ConfigError
from lchat.home import config as home_config
from lchat.home import passkeys as pk
from lchat.home.limits import Limits, Rate, RateLimited, TokenBuckets, address_key, client_address
from tests import authenticator as soft
from tests.authenticator import RS256, SoftwareAuthenticator, cbor


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class TokenBucketTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_000_000)

    def test_a_burst_then_the_rate(self) -> None:
        """3 per 60 s: three at once, then one every 20 s; the wait is exact."""
        buckets = TokenBuckets("t", Rate(3, 60), self.clock.seconds)
        for _ in range(3):
            self.assertEqual(buckets.wait("a"), 0.0)
            buckets.spend("a")
        self.assertAlmostEqual(buckets.wait("a"), 20.0)
        self.assertEqual(buckets.wait("b"), 0.0)  # another key has its own bucket
        self.clock.advance(19.5)
        self.assertAlmostEqual(buckets.wait("a"), 0.5)
        self.clock.advance(0.5)
        self.assertEqual(buckets.wait("a"), 0.0)
        buckets.spend("a")
        self.assertAlmostEqual(buckets.wait("a"), 20.0)
        self.clock.advance(3600)  # never more than the burst
        for _ in range(3):
            buckets.spend("a")
        self.assertGreater(buckets.wait("a"), 0)

    def test_off_never_refuses_and_tracks_nothing(self) -> None:
        buckets = TokenBuckets("t", Rate(0, 1), self.clock.seconds)
        for _ in range(1000):
            buckets.spend("a")
        self.assertEqual((buckets.wait("a"), len(buckets)), (0.0, 0))

    def test_failures_past_empty_deepen_the_wait(self) -> None:
        buckets = TokenBuckets("t", Rate(2, 10), self.clock.seconds)
        for _ in range(4):
            buckets.spend("a")
        self.assertAlmostEqual(buckets.wait("a"), 15.0)  # -2 tokens: 3 to wait for, 5 s each

    def test_memory_is_bounded(self) -> None:
        """At most max_keys keys; the least recently touched go first; a bucket that filled
        up again is dropped as new keys come."""
        buckets = TokenBuckets("bounded", Rate(5, 50), self.clock.seconds, max_keys=100)
        evicted = metric("lchat_home_limit_evictions_total", limit="bounded")
        for i in range(1000):
            buckets.spend(f"k{i}", 5)
        self.assertEqual(len(buckets), 100)
        self.assertEqual(metric("lchat_home_limit_evictions_total", limit="bounded") - evicted, 900)
        self.assertGreater(buckets.wait("k999"), 0)  # the newest are kept
        self.assertEqual(buckets.wait("k0"), 0.0)  # the oldest were forgotten
        self.clock.advance(50)  # every bucket is full again
        for i in range(10):
            buckets.spend(f"new{i}")
        self.assertLess(len(buckets), 100)


class LimitsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.limits = Limits.build(
            {"register_ip": Rate(2, 3600), "register": Rate(3, 3600), "ip": Rate(100, 1)},
            self.clock.seconds,
        )

    def test_all_or_nothing_and_retry_after(self) -> None:
        """A request that one bucket refuses takes from none: the per-address limit refusing
        does not spend the global one, nor the other way round."""
        refused = metric("lchat_home_limited_total", limit="register_ip")
        for _ in range(2):
            self.limits.take([("register_ip", "a"), ("register", "*")])
        with self.assertRaises(RateLimited) as caught:
            self.limits.take([("register_ip", "a"), ("register", "*")])
        self.assertEqual((caught.exception.limit, caught.exception.header), ("register_ip", "1800"))
        self.assertEqual(metric("lchat_home_limited_total", limit="register_ip") - refused, 1)
        self.limits.take([("register_ip", "b"), ("register", "*")])  # the 3rd global token
        with self.assertRaises(RateLimited) as caught:
            self.limits.take([("register_ip", "c"), ("register", "*")])
        self.assertEqual(caught.exception.limit, "register")
        self.clock.advance(1200)  # a third of the global bucket came back: one token
        self.limits.take([("register_ip", "c"), ("register", "*")])
        self.limits.take([("register_ip", "c")])  # c's own bucket was not spent by the refusal

    def test_retry_after_rounds_up_to_a_whole_second(self) -> None:
        self.assertEqual(RateLimited("x", 0.01).header, "1")
        self.assertEqual(RateLimited("x", 2.2).header, "3")

    def test_unlisted_limits_are_off(self) -> None:
        for _ in range(10_000):
            self.limits.take([("account", "uid"), ("failures_ip", "a")])
        with self.assertRaises(ValueError):
            Limits.build({"nonsense": Rate(1, 1)}, self.clock.seconds)

    def test_refusals_are_logged_at_most_once_a_minute(self) -> None:
        logged: list[Any] = []
        observer = cast(ILogObserver, logged.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        for _ in range(2):
            self.limits.take([("register_ip", "a")])
        for _ in range(50):
            with self.assertRaises(RateLimited):
                self.limits.take([("register_ip", "a")])
        self.clock.advance(61)
        self.limits.take([("register_ip", "z")])
        for _ in range(2):
            with self.assertRaises(RateLimited):
                self.limits.take([("register_ip", "a"), ("ip", "a")])
        lines = [e for e in logged if "rate limit" in str(e.get("log_format", ""))]
        self.assertEqual([e["count"] for e in lines], [1, 50])


class ClientAddressTests(SynchronousTestCase):
    def request(self, peer: IAddress, *forwarded: bytes) -> DummyRequest:
        request = DummyRequest([b""])
        request.client = peer
        for value in forwarded:
            request.requestHeaders.addRawHeader(b"x-forwarded-for", value)
        return request

    def test_the_router_on_the_unix_socket_is_believed_for_the_last_entry_only(self) -> None:
        unix = UNIXAddress(b"/run/lchat/home.sock")
        self.assertEqual(client_address(self.request(unix, b"203.0.113.9")), "203.0.113.9")
        spoofed = self.request(unix, b"1.2.3.4, 10.0.0.1", b"198.51.100.7")
        self.assertEqual(client_address(spoofed), "198.51.100.7")
        self.assertEqual(client_address(self.request(unix)), "local")

    def test_a_tcp_peer_is_itself_unless_a_trusted_proxy(self) -> None:
        peer = IPv4Address("TCP", "192.0.2.5", 4444)
        self.assertEqual(client_address(self.request(peer, b"203.0.113.9")), "192.0.2.5")
        trusted = home_config.parse_trusted("192.0.2.0/24")
        self.assertEqual(client_address(self.request(peer, b"203.0.113.9"), trusted), "203.0.113.9")

    def test_ipv6_is_keyed_by_its_64(self) -> None:
        self.assertEqual(address_key("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64")
        self.assertEqual(address_key("2001:db8:1:2:bbbb::9"), "2001:db8:1:2::/64")
        self.assertEqual(address_key("::ffff:198.51.100.1"), "198.51.100.1")
        peer = IPv6Address("TCP", "2001:db8::7", 4444)
        self.assertEqual(client_address(self.request(peer)), "2001:db8::/64")
        self.assertEqual(address_key("x" * 500), "x" * 64)


class SettingsTests(SynchronousTestCase):
    def load(self, **environ: str) -> home_config.HomeConfig:
        return home_config.load(env_file="/nonexistent-ok", environ=environ)

    def setUp(self) -> None:
        self.patch(home_config, "read_env_file", lambda path, must_exist: {})

    def test_defaults_limit_everything(self) -> None:
        cfg = self.load()
        self.assertEqual(cfg.rates["register_ip"], Rate(10, 3600))
        self.assertTrue(all(rate.enabled for rate in cfg.rates.values()))
        self.assertEqual((cfg.max_devices, cfg.vault_max, cfg.step_up_window), (20, 18432, 300.0))

    def test_settings_and_refusals(self) -> None:
        cfg = self.load(
            LCHAT_HOME_LIMIT_IP="0",
            LCHAT_HOME_LIMIT_MINTS="5/60",
            LCHAT_HOME_MAX_DEVICES="3",
            LCHAT_HOME_TRUSTED_PROXIES="10.0.0.1, 10.1.0.0/16",
        )
        self.assertFalse(cfg.rates["ip"].enabled)
        self.assertEqual(cfg.rates["mints"], Rate(5, 60))
        self.assertEqual(cfg.max_devices, 3)
        self.assertEqual(len(cfg.trusted_proxies), 2)
        for name, value in (
            ("LCHAT_HOME_LIMIT_REGISTER", "lots"),
            ("LCHAT_HOME_LIMIT_REGISTER", "-1/60"),
            ("LCHAT_HOME_LIMIT_VAULT_WRITES", "10/0"),
            ("LCHAT_HOME_MAX_DEVICES", "0"),
            ("LCHAT_HOME_VAULT_MAX", str(64 * 1024)),
            ("LCHAT_HOME_STEP_UP_WINDOW", "86400"),
            ("LCHAT_HOME_TRUSTED_PROXIES", "not-an-address"),
        ):
            with self.assertRaises(ConfigError) as caught:
                self.load(**{name: value})
            self.assertIn(name, str(caught.exception))


def rsa_cose(bits: int, exponent: int = 65537) -> bytes:
    n = (1 << (bits - 1)) | int.from_bytes(os.urandom(bits // 8), "big") | 1
    n &= (1 << bits) - 1
    return cbor({1: 3, 3: RS256, -1: n.to_bytes(bits // 8, "big"), -2: exponent.to_bytes(4, "big")})


class RsaBoundTests(SynchronousTestCase):
    def test_the_modulus_and_exponent_are_bounded(self) -> None:
        for bits in (2048, 3072, 4096):
            pk.check_public_key(rsa_cose(bits))
        for cose in (rsa_cose(1024), rsa_cose(8192), rsa_cose(2048, 65536), rsa_cose(2048, 1)):
            with self.assertRaises(pk.CeremonyFailed):
                pk.check_public_key(cose)
        with self.assertRaises(pk.CeremonyFailed):
            pk.check_public_key(b"\xa1\x01")  # not even CBOR that parses

    def test_a_registration_with_a_small_rsa_key_is_refused(self) -> None:
        from cryptography.hazmat.primitives.asymmetric import rsa

        self.patch(
            soft,
            "generate_key",
            lambda algorithm: rsa.generate_private_key(public_exponent=65537, key_size=1024),  # noqa: S505 (the point)
        )
        passkeys = pk.Passkeys(rp_name="lchat")
        start = passkeys.begin_registration(rp_id="home.example.test", uid="u1", user_name="x")
        response = SoftwareAuthenticator(algorithm=RS256).create(
            start.options_json, origin="https://home.example.test"
        )
        with self.assertRaises(pk.CeremonyFailed) as caught:
            passkeys.finish_registration(
                response,
                challenge=start.challenge,
                rp_id="home.example.test",
                origin="https://home.example.test",
            )
        self.assertIn("modulus", str(caught.exception))

"""The ACME pieces on their own: the HTTP-01 responder behind port 80, the sealed cache entries,
the renewal schedule and the issuer's backoff (on a fake clock)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import time
from typing import Any

from attrs import evolve
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from lchat.acme import cache
from lchat.acme.cache import CacheEntryError, Certificate, CertName, SharedCache
from lchat.acme.client import IssuanceError
from lchat.acme.http01 import ChallengeResponder, PendingIndex
from lchat.acme.issuer import DAY, Issuer
from lchat.redirect import RedirectToHTTPS
from tests.s3servers import shared_server, store_for

TOKEN = "evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA"


def certificate(host: str, days: int = 90) -> Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, host)]))
        .issuer_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "Test CA")]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Certificate.parse(key_pem, leaf.public_bytes(serialization.Encoding.PEM))


class ResponderTests(TestCase):
    """Through the real port-80 site (RedirectToHTTPS with the responder as its hook)."""

    def setUp(self) -> None:
        self.shared: dict[str, str] = {}
        self.lookups: list[str] = []

        async def lookup(token: str) -> str | None:
            self.lookups.append(token)
            return self.shared.get(token)

        self.responder = ChallengeResponder(lookup=lookup, clock=reactor)
        site = Site(RedirectToHTTPS(acme_challenge=self.responder.resource()))
        r: Any = reactor
        self.port = r.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    async def get(self, path: str) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.port.getHost().port}{path}".encode()
        response = await Agent(reactor).request(
            b"GET", url, Headers({b"host": [b"chat.example.com"]})
        )
        return response.code, await readBody(response)

    async def test_a_published_token_is_answered(self) -> None:
        self.responder.publish(TOKEN, TOKEN + ".thumbprint")
        code, body = await self.get(f"/.well-known/acme-challenge/{TOKEN}")
        self.assertEqual((code, body), (200, (TOKEN + ".thumbprint").encode()))
        self.responder.withdraw(TOKEN)
        code, _ = await self.get(f"/.well-known/acme-challenge/{TOKEN}")
        self.assertEqual(code, 404)
        self.assertEqual(self.lookups, [TOKEN])  # a local miss asks the shared cache

    async def test_a_token_from_the_shared_cache(self) -> None:
        self.shared[TOKEN] = "from-the-bucket"
        code, body = await self.get(f"/.well-known/acme-challenge/{TOKEN}")
        self.assertEqual((code, body), (200, b"from-the-bucket"))

    async def test_hostile_paths_never_reach_a_lookup(self) -> None:
        for path in (
            "/.well-known/acme-challenge/",
            "/.well-known/acme-challenge/..%2F..%2Fetc%2Fpasswd",
            "/.well-known/acme-challenge/a/b",
            "/.well-known/acme-challenge/" + "A" * 300,
            "/.well-known/acme-challenge/to%00ken",
            "/.well-known/acme-challenge/tok.en",
            "/.well-known/acme-challenge/not-a-CA-token",  # < 128 bits: no CA sends it
        ):
            code, _ = await self.get(path)
            self.assertEqual(code, 404, path)
        self.assertEqual(self.lookups, [])
        # everything else on port 80 still redirects
        code, _ = await self.get("/.well-known/other")
        self.assertEqual(code, 301)

    async def test_a_failing_lookup_is_a_404(self) -> None:
        async def broken(token: str) -> str | None:
            raise OSError("bucket down")

        self.responder.lookup = broken
        code, _ = await self.get(f"/.well-known/acme-challenge/{TOKEN}")
        self.assertEqual(code, 404)
        self.flushLoggedErrors()

    def test_publish_refuses_a_non_token(self) -> None:
        with self.assertRaises(ValueError):
            self.responder.publish("../x", "y")


class PendingIndexTests(TestCase):
    """The listing of certs/challenges/ every lookup shares, on a fake clock."""

    def test_listings_are_shared_paced_and_one_at_a_time(self) -> None:
        clock = Clock()
        calls: list[Deferred[frozenset[str]]] = []

        def list_tokens() -> Deferred[frozenset[str]]:
            calls.append(Deferred())
            return calls[-1]

        index = PendingIndex(clock, list_tokens, interval=0.5)
        first = [index.holds(f"t{i}") for i in range(100)]
        clock.advance(0)
        self.assertEqual(len(calls), 1)  # a hundred lookups, one listing
        late = index.holds("t1")  # arrived after that listing began: waits for the next
        clock.advance(1.0)
        self.assertEqual(len(calls), 1)  # never two at once
        calls[0].callback(frozenset({"t1"}))
        self.assertEqual([d.result for d in first[:3]], [False, True, False])
        self.assertNoResult(late)
        clock.advance(0)
        self.assertEqual(len(calls), 2)  # the next one, as soon as the first is done
        calls[1].callback(frozenset({"t1", "t9"}))
        self.assertTrue(self.successResultOf(late))
        self.assertTrue(self.successResultOf(index.holds("t9")))  # in the last one: no wait
        self.assertEqual(len(calls), 2)
        again = index.holds("t2")
        clock.advance(0.4)
        self.assertEqual(len(calls), 2)  # paced: not before 0.5 s after the last began
        clock.advance(0.1)
        self.assertEqual(len(calls), 3)
        calls[2].errback(OSError("bucket down"))
        self.failureResultOf(again, OSError)

    def test_a_challenge_object_is_good_for_its_token_only_and_under_the_fleets_keys(self) -> None:
        key, old, stranger = bytes(32), bytes(range(32)), bytes([9] * 32)
        body = cache.seal_challenge(TOKEN, TOKEN + ".thumb", key)
        self.assertEqual(cache.open_challenge(TOKEN, body, key), TOKEN + ".thumb")
        self.assertEqual(cache.open_challenge(TOKEN, body, old, key), TOKEN + ".thumb")
        other = "x" * 43
        for args in (
            (TOKEN, body, stranger),  # another fleet's key
            (other, body, key),  # moved to another token's name
            (TOKEN, (TOKEN + ".thumb").encode(), key),  # unsealed, as before
            (TOKEN, body.replace(b".thumb", b".thumX"), key),  # altered
            (TOKEN, b"x" * 5000, key),
        ):
            with self.assertRaises(cache.ChallengeRefused):
                cache.open_challenge(*args)


class SealedEntryTests(TestCase):
    KEY = bytes(range(32))

    def test_round_trip(self) -> None:
        name = CertName("host", "chat.example.com")
        cert = certificate(name.name)
        body = cache.seal(name, cert, self.KEY, "box-1")
        self.assertNotIn(b"PRIVATE KEY", body)
        self.assertEqual(cache.unseal(name, body, self.KEY), cert)
        self.assertEqual(cache.describe(body)["issued_by"], "box-1")

    def test_another_key_or_name_or_chain_does_not_decrypt(self) -> None:
        name = CertName("host", "chat.example.com")
        body = cache.seal(name, certificate(name.name), self.KEY, "box-1")
        with self.assertRaisesRegex(CacheEntryError, "LCHAT_CERT_CACHE_KEY"):
            cache.unseal(name, body, b"x" * 32)
        with self.assertRaisesRegex(CacheEntryError, "does not decrypt"):
            cache.unseal(CertName("host", "other.example.com"), body, self.KEY)
        data = json.loads(body)
        data["chain"] = certificate("chat.example.com").chain_pem.decode()
        with self.assertRaisesRegex(CacheEntryError, "does not decrypt"):
            cache.unseal(name, json.dumps(data).encode(), self.KEY)

    def test_the_issuing_directory_cannot_be_changed_without_the_key(self) -> None:
        name = CertName("host", "chat.example.com")
        cert = evolve(certificate(name.name), origin="https://ca.example/directory")
        data = json.loads(cache.seal(name, cert, self.KEY, "box-1"))
        self.assertEqual(
            cache.unseal(name, json.dumps(data).encode(), self.KEY).origin, cert.origin
        )
        data["directory"] = "https://other.example/directory"
        with self.assertRaisesRegex(CacheEntryError, "does not decrypt"):
            cache.unseal(name, json.dumps(data).encode(), self.KEY)

    def test_garbage_is_refused_clearly(self) -> None:
        name = CertName.wildcard("example.com")
        for body in (b"", b"{", b"[]", b'{"format": "other"}', b'{"format": "lchat-cert/1"}'):
            with self.assertRaises(CacheEntryError):
                cache.unseal(name, body, self.KEY)

    def test_names_and_stems(self) -> None:
        self.assertEqual(
            CertName.from_stem("wildcard-example.com"), CertName.wildcard("example.com")
        )
        self.assertEqual(
            CertName.from_stem("chat.example.com"), CertName("host", "chat.example.com")
        )
        for stem in ("default", "../x", "acme-account", "Chat.Example.com"):
            self.assertIsNone(CertName.from_stem(stem))
        self.assertEqual(CertName.wildcard("example.com").label, "*.example.com")


class _Store:
    """What the issuer reads of the certificate store (the served certificates)."""

    def __init__(self) -> None:
        self.served: dict[str, Any] = {}

    def certificates(self) -> dict[str, Any]:
        return self.served

    def rescan(self) -> Deferred[None]:
        return succeed(None)

    def refused(self) -> dict[str, str]:
        return {}


class _Account:
    directory_url = "https://ca.test/directory"

    def __init__(self) -> None:
        import threading

        self.stopping = threading.Event()


class ScheduleTests(TestCase):
    def issuer(self, clock: Clock, **kwargs: Any) -> Issuer:
        directory = tempfile.mkdtemp(prefix="iss", dir="/tmp")
        self.addCleanup(os.rmdir, directory)
        return Issuer(
            clock,
            store=_Store(),  # type: ignore[arg-type]
            local=cache.LocalCache(directory),
            account=_Account(),  # type: ignore[arg-type]
            may_issue=lambda host: True,
            http01=ChallengeResponder(clock=clock),
            monotonic=time.monotonic,
            **kwargs,
        )

    def test_renewal_is_thirty_days_ahead_with_at_most_a_day_of_jitter(self) -> None:
        issuer = self.issuer(Clock())
        not_after = 100 * DAY
        times = [issuer.renew_time(not_after, serial, 10 * DAY) for serial in range(0, 10**6, 997)]
        self.assertTrue(all(not_after - 31 * DAY <= t <= not_after - 30 * DAY for t in times))
        self.assertGreater(max(times) - min(times), 0.9 * DAY)  # spread, not one instant
        # a short-lived certificate renews at two thirds of its life, not before it is issued
        self.assertLessEqual(abs(issuer.renew_time(9 * DAY, 0, 0.0) - 6 * DAY), 1.0)

    def test_failures_back_off_doubling_to_the_cap(self) -> None:
        clock = Clock()
        issuer = self.issuer(clock, backoff=(60.0, 600.0))
        name = CertName("host", "chat.example.com")
        delays = []
        for _ in range(6):
            issuer._failed(name, IssuanceError("validation", "no"))
            delays.append(issuer._failures[name][1] - clock.seconds())
        for got, want in zip(delays, (60, 120, 240, 480, 600, 600), strict=True):
            self.assertLessEqual(abs(got - want), want * 0.11)
        self.assertFalse(issuer._may_try(name))
        clock.advance(700)
        self.assertTrue(issuer._may_try(name))
        # a rate limit waits at least as long as the CA asks
        issuer._failed(name, IssuanceError("order", "rateLimited", retry_after=3600.0))
        self.assertGreater(issuer._failures[name][1] - clock.seconds(), 3000)
        self.flushLoggedErrors()

    def test_hosts_under_a_pending_wildcard_wait_for_it(self) -> None:
        clock = Clock()
        issuer = self.issuer(clock, wildcard_domains=("example.com",))
        issuer.running = True
        issuer.want("a.example.com")
        issuer.want("a.b.example.com")  # not covered by *.example.com: its own order
        self.assertEqual(sorted(n.label for n in issuer._inflight), ["a.b.example.com"])
        issuer._wildcards["example.com"] = "failed"  # the wildcard failed: per-host now
        issuer.want("a.example.com")
        self.assertEqual(
            sorted(n.label for n in issuer._inflight), ["a.b.example.com", "a.example.com"]
        )
        issuer._inflight.clear()

    def test_want_says_whether_a_certificate_is_coming(self) -> None:
        """The front door holds a first handshake only while its certificate is really being
        ordered (lchat.proxy.tls_accept): want's answer decides."""
        clock = Clock()
        issuer = self.issuer(clock)
        self.assertFalse(issuer.want("chat.example.com"), "not running: nothing is ordered")
        issuer.running = True
        self.assertTrue(issuer.want("chat.example.com"))
        self.assertTrue(issuer.want("chat.example.com"), "joined: still coming")
        issuer._inflight.clear()
        name = CertName("host", "chat.example.com")
        issuer._failed(name, IssuanceError("validation", "no"))
        self.assertFalse(issuer.want("chat.example.com"), "backing off: nothing is coming")
        self.flushLoggedErrors()

        refusing = self.issuer(clock)
        refusing._may_issue = lambda host: False  # (a row that is not ready, say)
        refusing.running = True
        self.assertFalse(refusing.want("chat.example.com"))
        no_http01 = self.issuer(clock)
        no_http01._http01 = None  # LCHAT_HTTP_ADDR=off: per-host issuance impossible
        no_http01.running = True
        self.assertFalse(no_http01.want("chat.example.com"))

        under = self.issuer(clock, wildcard_domains=("example.com",))
        under.running = True
        under._wildcards["example.com"] = "ok"  # believed served, but the file went away
        self.assertTrue(under.want("a.example.com"), "its wildcard is being ordered")
        for issuer_ in (issuer, under):
            issuer_._inflight.clear()

    def test_a_wildcard_that_went_missing_is_ordered_again_at_once(self) -> None:
        clock = Clock()
        issuer = self.issuer(clock, wildcard_domains=("example.com",))
        issuer.running = True
        issuer._wildcards["example.com"] = "ok"  # believed served...
        issuer.want("a.example.com")  # ...but a handshake found none: the file went away
        self.assertEqual(sorted(n.label for n in issuer._inflight), ["*.example.com"])
        self.assertEqual(issuer._wildcards["example.com"], "pending")  # hosts keep waiting
        issuer._inflight.clear()

    def test_the_own_host_is_issued_at_start_without_a_handshake(self) -> None:
        clock = Clock()
        issuer = self.issuer(clock, own_hosts=("box-1.example.net",))
        issuer.running = True
        issuer.check_renewals()  # what start does
        self.assertEqual(sorted(n.label for n in issuer._inflight), ["box-1.example.net"])
        issuer._inflight.clear()


class _IssuingAccount(_Account):
    """Stands in for the CA in unit tests: every order "succeeds" with a fresh certificate (or
    fails with ``fail``), counting orders as the real account reports them."""

    def __init__(self, fail: IssuanceError | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.orders = 0

    def issue(self, names: list[str], solver: Any, *, deadline: float, on_order: Any) -> Any:
        self.orders += 1
        on_order()
        if self.fail is not None:
            raise self.fail
        cert = certificate(names[0].removeprefix("*."))
        from lchat.acme.client import Issued

        return Issued(cert.key_pem, cert.chain_pem)


def running_issuer(test: TestCase, account: _Account, store: Any, **kwargs: Any) -> Issuer:
    """A started issuer on the real reactor (its orders run in threads), stopped at cleanup."""
    directory = tempfile.mkdtemp(prefix="iss", dir="/tmp")
    test.addCleanup(shutil.rmtree, directory, True)
    issuer = Issuer(
        reactor,
        store=store,
        local=cache.LocalCache(directory),
        account=account,  # type: ignore[arg-type]
        may_issue=lambda host: True,
        http01=ChallengeResponder(clock=reactor),
        monotonic=time.monotonic,
        **kwargs,
    )
    issuer.startService()
    test.addCleanup(issuer.stopService)
    return issuer


class InstallFailureTests(TestCase):
    """A certificate obtained but not served is installed again, never ordered again."""

    def issuer(self, account: _Account, store: Any, **kwargs: Any) -> Issuer:
        return running_issuer(self, account, store, **kwargs)

    async def test_a_certificate_the_store_never_serves_is_not_ordered_again(self) -> None:
        account = _IssuingAccount()
        issuer = self.issuer(account, _Store())  # its certificates() never shows the file
        name = CertName("host", "chat.example.com")
        for _ in range(4):
            await issuer.start(name, "test")
        self.assertEqual(account.orders, 1)
        self.assertEqual(issuer._failures[name][2], "install")
        self.assertIn(name, issuer._unserved)
        self.flushLoggedErrors()

    async def test_a_loop_is_stopped_below_the_cas_duplicate_limit(self) -> None:
        account = _IssuingAccount()
        issuer = self.issuer(account, _Store())
        name = CertName("host", "chat.example.com")
        for _ in range(6):
            issuer._unserved.clear()  # as if each one had been lost some other way
            await issuer.start(name, "test")
        self.assertEqual(account.orders, 3)
        self.assertEqual(issuer._failures[name][2], "limit")
        self.flushLoggedErrors()

    def test_a_host_no_file_can_hold_is_never_ordered(self) -> None:
        issuer = self.issuer(_IssuingAccount(), _Store())
        issuer.want("wildcard-party.example.com")
        self.assertEqual(issuer._inflight, {})


class SharedLockTests(TestCase):
    """The cross-box issuance lock, on a real bucket (moto)."""

    KEY = bytes(range(32))

    async def test_a_failed_order_keeps_the_lock_so_the_fleet_does_not_retry_it_at_once(
        self,
    ) -> None:
        server = await shared_server("moto")
        store = store_for(server, await server.new_bucket())
        self.addCleanup(store.close)
        name = CertName("host", "chat.example.com")
        failing = _IssuingAccount(fail=IssuanceError("validation", "unauthorized: 404"))
        box_a = running_issuer(
            self,
            failing,
            _Store(),
            shared=SharedCache(store, self.KEY, prefix="p", box_id="a", monotonic=time.monotonic),
        )
        await box_a.start(name, "test")
        self.assertEqual((failing.orders, box_a._failures[name][2]), (1, "validation"))
        lock = await store.get("p/certs/locks/chat.example.com.json")
        self.assertIn(b'"owner":"a#', lock.body)  # still held: it expires by itself

        # Another box wants the same name: it waits for the lock, it does not order.
        other = _IssuingAccount()
        box_b = running_issuer(
            self,
            other,
            _Store(),
            shared=SharedCache(store, self.KEY, prefix="p", box_id="b", monotonic=time.monotonic),
            shared_poll=0.1,
        )
        waiting = box_b.start(name, "test")
        await deferLater(reactor, 1.0, lambda: None)
        self.assertEqual(other.orders, 0)
        self.assertIn(name, box_b._inflight)
        await box_b.stopService()  # a waiter that is stopped gives up quietly
        await waiting
        self.assertNotIn(name, box_b._failures)

        # Box A itself does not sit waiting on the lock its failure keeps: it backs off at once.
        failing.fail = None
        await box_a.start(name, "retry")
        self.assertEqual(failing.orders, 1)
        self.assertEqual(box_a._failures[name][2], "shared")
        self.assertGreater(box_a._failures[name][1] - reactor.seconds(), 30)  # the lock's time
        self.flushLoggedErrors()

    async def test_a_failure_of_the_box_itself_releases_the_lock(self) -> None:
        server = await shared_server("moto")
        store = store_for(server, await server.new_bucket())
        self.addCleanup(store.close)
        name = CertName("host", "chat.example.com")
        account = _IssuingAccount(fail=IssuanceError("network", "cannot reach the CA"))
        box = running_issuer(
            self,
            account,
            _Store(),
            shared=SharedCache(store, self.KEY, prefix="p", box_id="a", monotonic=time.monotonic),
        )
        await box.start(name, "test")
        self.assertEqual(box._failures[name][2], "network")
        listed = await store.list("p/certs/locks/")
        self.assertEqual(listed, [])  # another box, which can reach the CA, may go ahead
        self.flushLoggedErrors()

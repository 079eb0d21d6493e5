"""The ACME test harness (``tests/acmeservers.py``) issues real certificates.

Each test gets its own challtestsrv and Pebble (about 0.3 s to start both) and drives them with
certbot's ``acme`` library directly, in a worker thread (it blocks), while the reactor serves the
HTTP-01 responses: an order for ``test-a.example.test`` over HTTP-01, one for ``*.example.test``
over DNS-01 (the TXT record set through challtestsrv's management API), and dnspython reading
records back from challtestsrv as a propagation check would. Issued chains are verified against
``roots_pem()`` with cryptography's X.509 path validation.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import dns.message
import dns.query
import dns.rcode
import dns.resolver
import josepy as jose
from acme import challenges, client, crypto_util, messages
from acme import errors as acme_errors
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.verification import PolicyBuilder, Store
from twisted.internet import reactor as _reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from tests import acmeservers

reactor: Any = _reactor
VALIDITY = 3600  # seconds: the lifetime Pebble gives issued certificates
# Seconds for one issuance; a healthy one takes about 1.2 s (the library sleeps 1 s before its
# first look at a finalized order).
DEADLINE = 30.0


class ChallengeResponder(Resource):
    """``/.well-known/acme-challenge/<token>`` -> the key authorization published for it."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.responses: dict[str, str] = {}  # path -> key authorization
        self.served: list[str] = []

    def render_GET(self, request: Request) -> bytes:
        path = (request.path or b"").decode()
        answer = self.responses.get(path)
        if answer is None:
            request.setResponseCode(404)
            return b"no such challenge\n"
        self.served.append(path)
        request.setHeader(b"content-type", b"text/plain")
        return answer.encode()


def _account(pebble: acmeservers.Pebble) -> tuple[client.ClientV2, jose.JWKRSA]:
    key = jose.JWKRSA(key=rsa.generate_private_key(public_exponent=65537, key_size=2048))
    net = client.ClientNetwork(
        key,
        verify_ssl=pebble.ca_file,  # type: ignore[arg-type]  # passed on as requests' verify=
        user_agent="lchat-tests",
    )
    acme = client.ClientV2(client.ClientV2.get_directory(pebble.directory_url, net), net)
    acme.new_account(messages.NewRegistration.from_data(terms_of_service_agreed=True))
    return acme, key


def _csr(names: list[str]) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return crypto_util.make_csr(key_pem, names)


def _wait_authorizations(acme: client.ClientV2, order: messages.OrderResource) -> None:
    """Poll every authorization until it leaves ``pending`` (the library polls once a second)."""
    deadline = time.monotonic() + DEADLINE
    for authz in order.authorizations:
        while acme.poll(authz)[0].body.status == messages.STATUS_PENDING:
            assert time.monotonic() < deadline, f"{authz.uri} still pending"
            time.sleep(0.05)


def _issue(
    acme: client.ClientV2,
    key: jose.JWKRSA,
    names: list[str],
    kind: type[challenges.KeyAuthorizationChallenge],
    publish: Callable[[messages.AuthorizationResource, Any, str], None],
) -> messages.OrderResource:
    """Order ``names``, answer each authorization's ``kind`` challenge after ``publish(authz,
    challenge, validation)`` has put the response in place, and return the finalized order."""
    order = acme.new_order(_csr(names))
    for authz in order.authorizations:
        # PEBBLE_AUTHZREUSE=0: nothing is carried over from an earlier order.
        assert authz.body.status == messages.STATUS_PENDING, authz.body.status
        challb = next(c for c in authz.body.challenges if isinstance(c.chall, kind))
        response, validation = challb.chall.response_and_validation(key)
        publish(authz, challb.chall, validation)
        acme.answer_challenge(challb, response)
    _wait_authorizations(acme, order)
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=DEADLINE)
    return acme.poll_and_finalize(order, deadline)


def _verify_chain(fullchain_pem: str, roots_pem: str, name: str) -> list[x509.Certificate]:
    """Path-validate the served chain to Pebble's root for ``name``; return the certificates."""
    certs = x509.load_pem_x509_certificates(fullchain_pem.encode())
    roots = x509.load_pem_x509_certificates(roots_pem.encode())
    verifier = PolicyBuilder().store(Store(roots)).build_server_verifier(x509.DNSName(name))
    verifier.verify(certs[0], certs[1:])  # raises VerificationError
    return certs


class AcmeServersTests(TestCase):
    timeout = 60

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        async def set_up() -> None:
            self.responder = ChallengeResponder()
            # Bound first, on a kernel-chosen port: Pebble is told the port it must validate on.
            port: IListeningPort = reactor.listenTCP(0, Site(self.responder), interface="127.0.0.1")
            self.addCleanup(port.stopListening)
            address = port.getHost()
            assert isinstance(address, IPv4Address)
            http_port = address.port
            self.pebble, self.dns = await acmeservers.start_acme(
                http_port, validity_seconds=VALIDITY
            )
            self.addCleanup(lambda: Deferred.fromCoroutine(self.dns.destroy()))
            self.addCleanup(lambda: Deferred.fromCoroutine(self.pebble.destroy()))

        return Deferred.fromCoroutine(set_up())

    def logs(self) -> str:
        return f"pebble:\n{self.pebble.log_tail()}\nchalltestsrv:\n{self.dns.log_tail()}"

    async def test_http01(self) -> None:
        name = "test-a.example.test"

        def publish(authz: messages.AuthorizationResource, chall: Any, validation: str) -> None:
            self.responder.responses[chall.path] = validation

        def run() -> messages.OrderResource:
            acme, key = _account(self.pebble)
            return _issue(acme, key, [name], challenges.HTTP01, publish)

        # (PEBBLE_AUTHZREUSE=0 makes reuse of a valid authorization rare, not impossible: seen
        # once in a full run, so nothing here depends on a second order being pending again;
        # tests that need fresh validation use a name, or a Pebble, of their own.)
        try:
            order = await deferToThread(run)
        except Exception as e:
            self.fail(f"HTTP-01 issuance failed: {e!r}\n{self.logs()}")
        self.assertEqual(order.body.status, messages.STATUS_VALID)
        # Pebble 2.4 fetches it three times at once ("Starting 3 validations": its stand-in for
        # multi-perspective validation), so a responder must serve concurrent identical requests.
        self.assertTrue(self.responder.served)
        self.assertEqual(set(self.responder.served), set(self.responder.responses))
        certs = _verify_chain(order.fullchain_pem, self.pebble.roots_pem(), name)
        san = certs[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(san.get_values_for_type(x509.DNSName), [name])
        lifetime = certs[0].not_valid_after_utc - certs[0].not_valid_before_utc
        # notAfter is inclusive: Pebble sets it to notBefore + validity - 1 s.
        self.assertEqual(lifetime, datetime.timedelta(seconds=VALIDITY - 1))
        # The chain is leaf + the intermediate the management interface serves.
        self.assertEqual(
            certs[1:], x509.load_pem_x509_certificates(self.pebble.intermediates_pem().encode())
        )

    async def test_dns01_wildcard(self) -> None:
        published: list[str] = []

        def publish(authz: messages.AuthorizationResource, chall: Any, validation: str) -> None:
            assert authz.body.wildcard and authz.body.identifier.value == "example.test"
            record = chall.validation_domain_name(authz.body.identifier.value)
            self.dns.set_txt(record, validation)
            published.append(record)

        def run() -> messages.OrderResource:
            acme, key = _account(self.pebble)
            try:
                return _issue(acme, key, ["*.example.test"], challenges.DNS01, publish)
            finally:
                for record in published:
                    self.dns.clear_txt(record)

        try:
            order = await deferToThread(run)
        except Exception as e:
            self.fail(f"DNS-01 issuance failed: {e!r}\n{self.logs()}")
        self.assertEqual(published, ["_acme-challenge.example.test"])
        self.assertEqual(order.body.status, messages.STATUS_VALID)
        certs = _verify_chain(order.fullchain_pem, self.pebble.roots_pem(), "any.example.test")
        san = certs[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(san.get_values_for_type(x509.DNSName), ["*.example.test"])
        host, port = self.dns.dns_address
        answer = dns.query.udp(
            dns.message.make_query("_acme-challenge.example.test.", "TXT"), host, 2, port
        )
        self.assertEqual(answer.answer, [])  # cleared

    async def test_wrong_answer_fails(self) -> None:
        """Pebble really checks: a wrong TXT value makes the authorization invalid."""

        def publish(authz: messages.AuthorizationResource, chall: Any, validation: str) -> None:
            self.dns.set_txt(chall.validation_domain_name(authz.body.identifier.value), "wrong")

        def run() -> None:
            acme, key = _account(self.pebble)
            _issue(acme, key, ["test-b.example.test"], challenges.DNS01, publish)

        with self.assertRaises(acme_errors.ValidationError):
            await deferToThread(run)

    def test_dns_records(self) -> None:
        host, port = self.dns.dns_address
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
        resolver.lifetime = 2.0
        name = "_acme-challenge.propagation.example.test"

        def txt(tcp: bool = False) -> list[bytes]:
            try:
                rrset = resolver.resolve(name, "TXT", tcp=tcp)
            except dns.resolver.NoAnswer:
                return []
            return sorted(s for r in rrset for s in r.strings)

        self.assertEqual(txt(), [])
        self.dns.set_txt(name, "first")
        self.assertEqual(txt(), [b"first"])
        self.assertEqual(txt(tcp=True), [b"first"])
        self.dns.set_txt(name + ".", "second")  # values accumulate; a trailing dot is optional
        self.assertEqual(txt(), [b"first", b"second"])
        self.dns.clear_txt(name)
        self.assertEqual(txt(), [])

        def a(qname: str) -> list[str]:
            return sorted(r.to_text() for r in resolver.resolve(qname, "A"))

        self.assertEqual(a("anything.example.test"), ["127.0.0.1"])  # default_ipv4
        self.dns.add_a("www.example.test", ["127.0.0.2", "127.0.0.3"])
        self.assertEqual(a("www.example.test"), ["127.0.0.2", "127.0.0.3"])
        self.dns.set_default_ipv4("127.0.0.9")
        self.assertEqual(a("anything.example.test"), ["127.0.0.9"])
        with self.assertRaises(dns.resolver.NoAnswer):  # -defaultIPv6 "": no AAAA anywhere
            resolver.resolve("anything.example.test", "AAAA")
        self.dns.clear_a("www.example.test")
        self.assertEqual(a("www.example.test"), ["127.0.0.9"])
        with self.assertRaisesRegex(RuntimeError, "HTTP 400"):
            self.dns.add_a("www.example.test", [])  # errors name the call

"""ACME end to end: the whole router (as twistd builds it) against a real Pebble CA.

Pebble validates HTTP-01 against the router's own port-80 listener and DNS-01 against
pebble-challtestsrv (fed by the DNSimple API double); handshakes are real TLS clients verifying
the served chain against Pebble's root.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import REGISTRY, generate_latest
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat import config
from lchat.acme.cache import CertName, key_id, split_pem
from lchat.acme.issuer import Issuer
from lchat.config import BoxConfig
from lchat.registry import Registry, Route
from lchat.tap import build_service, listening_ports
from tests import acmeservers
from tests.dnsimple_double import DNSimpleDouble
from tests.s3servers import free_ports, shared_server, start_server

HOST = "chat.example.test"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def handshake(
    port: int, server_name: str, cafile: str | None, address: str = "127.0.0.1"
) -> x509.Certificate | str:
    """One TLS handshake: the verified leaf, or why it failed (a string)."""
    context = ssl.create_default_context(cafile=cafile)
    if cafile is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((address, port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=server_name) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der)
    except (ssl.SSLError, OSError) as e:
        return f"{type(e).__name__}: {e}"


def make_cert(
    directory: str,
    host: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    origin: str = "",
) -> int:
    """A self-signed ``<host>.pem`` in the cache layout; returns its serial."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "old test CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, host)]))
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ) + cert.public_bytes(serialization.Encoding.PEM)
    if origin:  # the marker line the issuer writes
        pem = f"# lchat acme: {origin}\n".encode() + pem
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"{host}.pem")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, pem)
    os.close(fd)
    return cert.serial_number


def write_file(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def lchat_cli(*argv: str) -> str:
    """Run the ``lchat`` CLI as a process (it runs a reactor of its own); its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "lchat.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": ROOT},
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(f"lchat {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    return done.stdout


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


async def gather(*coroutines: Any) -> list[Any]:
    return await gatherResults([Deferred.fromCoroutine(c) for c in coroutines])


class Box:
    """One router's directories, registry and config."""

    def __init__(self, test: TestCase, address: str = "127.0.0.1") -> None:
        self.dir = tempfile.mkdtemp(prefix="acme", dir="/tmp")
        test.addCleanup(shutil.rmtree, self.dir, True)
        self.address = address
        self.data = os.path.join(self.dir, "d")
        self.run = os.path.join(self.dir, "r")
        os.mkdir(self.data)
        self.acme = os.path.join(self.data, "acme")
        self.env = os.path.join(self.dir, "router.env")
        with open(self.env, "w") as f:
            f.write(f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR={self.run}\nLCHAT_UNITS=builtin\n")
        self.registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        self.registry.migrate()

    def register(self, host: str, status: str = "ready") -> None:
        self.registry.insert(
            Route(
                host=host,
                kind="service",
                socket=os.path.join(self.run, f"{host}.sock"),
                status=status,  # type: ignore[arg-type]
            )
        )

    def config(self, **flags: str) -> BoxConfig:
        environ = {"PATH": os.environ.get("PATH", "")}
        return config.load(env_file=self.env, environ=environ, flags=flags)


class AcmeTestCase(TestCase):
    timeout = 120

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        self.http_port = free_ports(1)[0]
        return Deferred.fromCoroutine(self._start_acme())

    async def _start_acme(self, default_ipv4: str = "127.0.0.1") -> None:
        self.pebble, self.dns = await acmeservers.start_acme(
            self.http_port, default_ipv4=default_ipv4
        )
        self.addCleanup(self.dns.destroy)
        self.addCleanup(self.pebble.destroy)
        self.roots = write_file(os.path.join(self.pebble.dir, "roots.pem"), self.pebble.roots_pem())

    def acme_flags(self, box: Box, **extra: str) -> dict[str, str]:
        flags = {
            "LCHAT_HTTP_ADDR": f"tcp:{self.http_port}:interface={box.address}",
            "LCHAT_HTTPS_ADDR": f"tcp:0:interface={box.address}",
            "LCHAT_ACME_DIRECTORY": self.pebble.directory_url,
            "LCHAT_ACME_CA_FILE": self.pebble.ca_file,
        }
        flags.update(extra)
        return flags

    def start(self, cfg: BoxConfig) -> tuple[Any, Issuer, int]:
        service = build_service(cfg, reactor, poll_interval=0.2)
        service.startService()
        self.addCleanup(service.stopService)
        ports: list[Any] = listening_ports(service)
        tls_port = next(
            p.getHost().port
            for p in ports
            if hasattr(p.getHost(), "port") and getattr(p, "secure", False)
        )
        self.start_port = tls_port
        try:
            issuer = service.getServiceNamed("acme")
        except KeyError:  # with the shared cache it stops before the bucket client does
            issuer = service.getServiceNamed("hibernation").getServiceNamed("acme")
        return service, issuer, tls_port

    async def served(
        self, port: int, name: str, address: str = "127.0.0.1", within: float = 30.0
    ) -> x509.Certificate:
        """Handshake until a certificate verifying against Pebble's root is served."""
        deadline = time.monotonic() + within
        while True:
            got = await deferToThread(handshake, port, name, self.roots, address)
            if isinstance(got, x509.Certificate):
                return got
            if time.monotonic() > deadline:
                self.fail(f"{name} never got a Pebble certificate on {address}: {got}")
            await sleep(0.2)


class HostIssuanceTests(AcmeTestCase):
    async def test_a_registered_host_gets_a_certificate_on_first_contact(self) -> None:
        box = Box(self)
        box.register(HOST)
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))

        # First contact: the handshake waits while the certificate is issued, and succeeds
        # (no default.pem is needed; LCHAT_TLS_FIRST_CONTACT_WAIT bounds the wait).
        leaf = await deferToThread(handshake, port, HOST, self.roots)
        assert isinstance(leaf, x509.Certificate), leaf
        self.assertEqual(
            leaf.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value.get_values_for_type(x509.DNSName),
            [HOST],
        )
        self.assertEqual(issuer.orders["host"], 1)
        # The file is in the cache layout, 0600, in a 0700 directory.
        path = os.path.join(box.acme, f"{HOST}.pem")
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(box.acme).st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(os.path.join(box.acme, "acme-account.key")).st_mode & 0o777, 0o600)

        # Counted where a scraper sees it.
        metrics = generate_latest(REGISTRY).decode()
        self.assertRegex(metrics, r'lchat_acme_orders_total\{type="host"\} [1-9]')
        self.assertRegex(
            metrics, r'lchat_acme_issuances_total\{outcome="issued",type="host"\} [1-9]'
        )
        self.assertIn("lchat_tls_certificates_expiring", metrics)
        # `lchat certs` lists it from the directory.
        env = write_file(os.path.join(box.dir, "cli.env"), read_bytes(box.env).decode())
        table = await deferToThread(lchat_cli, "certs", "--env-file", env)
        self.assertRegex(table, rf"{HOST}\s+host\s+Pebble.*\s+dir\n")

        # More handshakes are served from the file: no second order.
        for _ in range(3):
            self.assertIsInstance(
                await deferToThread(handshake, port, HOST, self.roots), x509.Certificate
            )
        self.assertEqual(issuer.orders["host"], 1)

    async def test_an_unregistered_host_never_causes_an_order(self) -> None:
        box = Box(self)
        box.register("stopped.example.test", status="failed")
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))
        for name in (
            "stranger.example.test",
            "stopped.example.test",
            "127.0.0.1",
            "bad_name.example.test",
        ):
            for _ in range(3):
                got = await deferToThread(handshake, port, name, None)
                self.assertIsInstance(got, str)
        await sleep(1.0)
        self.assertEqual(issuer.orders, {"host": 0, "wildcard": 0})
        self.assertNotIn("acme-account.key", listing(box.acme))

    async def test_fifty_concurrent_handshakes_cause_one_order(self) -> None:
        box = Box(self)
        box.register(HOST)
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))

        def storm() -> list[x509.Certificate | str]:
            with concurrent.futures.ThreadPoolExecutor(50) as pool:
                return list(pool.map(lambda _: handshake(port, HOST, self.roots), range(50)))

        results = await deferToThread(storm)
        self.assertEqual(len(results), 50)
        await self.served(port, HOST)
        self.assertEqual(issuer.orders["host"], 1)

    async def test_plain_http_proxying_still_answers_challenges(self) -> None:
        # LCHAT_HTTP_REDIRECT=off: port 80 proxies, and challenge paths go to the responder.
        box = Box(self)
        box.register(HOST)
        _, issuer, port = self.start(box.config(**self.acme_flags(box, LCHAT_HTTP_REDIRECT="off")))
        await deferToThread(handshake, port, HOST, self.roots)
        await self.served(port, HOST)
        self.assertEqual(issuer.orders["host"], 1)

    async def test_a_failed_order_backs_off(self) -> None:
        # The CA cannot reach us (nothing listens where Pebble validates): validation fails,
        # and further handshakes within the backoff do not order again.
        box = Box(self)
        box.register(HOST)
        flags = self.acme_flags(box, LCHAT_HTTP_ADDR=f"tcp:{free_ports(1)[0]}:interface=127.0.0.1")
        _, issuer, port = self.start(box.config(**flags))
        await deferToThread(handshake, port, HOST, self.roots)
        # Until the order has failed: Pebble's refusal took 20 s once in a full run (2 cores).
        for _ in range(600):
            if HOST not in {n.name for n in issuer._inflight} and issuer.orders["host"]:
                break
            await sleep(0.1)
        self.assertEqual(issuer.orders["host"], 1)
        failures = issuer._failures
        self.assertEqual([n.name for n in failures], [HOST])
        for _ in range(5):
            await deferToThread(handshake, port, HOST, self.roots)
        await sleep(0.5)
        self.assertEqual(issuer.orders["host"], 1)
        # `lchat certs` says so, from the running router.
        env = write_file(os.path.join(box.dir, "cli.env"), read_bytes(box.env).decode())
        table = await deferToThread(lchat_cli, "certs", "--env-file", env)
        self.assertRegex(table, rf"failing: {HOST}: 1 in a row, last at validation: .*next try in")
        self.flushLoggedErrors()


class RenewalTests(AcmeTestCase):
    async def test_a_certificate_near_expiry_is_replaced_without_restart(self) -> None:
        box = Box(self)
        box.register(HOST)
        now = datetime.datetime.now(datetime.UTC)
        old_serial = make_cert(
            box.acme, HOST, now - datetime.timedelta(days=80), now + datetime.timedelta(days=5)
        )
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))
        leaf = await self.served(port, HOST)  # verified against Pebble: the renewed one
        self.assertNotEqual(leaf.serial_number, old_serial)
        self.assertEqual(issuer.orders["host"], 1)

    async def test_a_certificate_from_another_acme_directory_is_replaced_at_once(self) -> None:
        # Switched from staging: its certificates are valid for weeks, but not from our CA.
        box = Box(self)
        box.register(HOST)
        now = datetime.datetime.now(datetime.UTC)
        old_serial = make_cert(
            box.acme,
            HOST,
            now - datetime.timedelta(days=10),
            now + datetime.timedelta(days=80),
            origin="https://acme-staging.example/directory",
        )
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))
        leaf = await self.served(port, HOST)
        self.assertNotEqual(leaf.serial_number, old_serial)
        self.assertEqual(issuer.orders["host"], 1)
        first_line = read_bytes(os.path.join(box.acme, f"{HOST}.pem")).split(b"\n")[0]
        self.assertEqual(first_line, f"# lchat acme: {self.pebble.directory_url}".encode())

    async def test_a_certificate_not_yet_due_is_left_alone(self) -> None:
        box = Box(self)
        box.register(HOST)
        now = datetime.datetime.now(datetime.UTC)
        serial = make_cert(
            box.acme, HOST, now - datetime.timedelta(days=10), now + datetime.timedelta(days=80)
        )
        _, issuer, port = self.start(box.config(**self.acme_flags(box)))
        issuer.check_renewals()
        await sleep(0.5)
        got = await deferToThread(handshake, port, HOST, None)
        assert isinstance(got, x509.Certificate)
        self.assertEqual(got.serial_number, serial)
        self.assertEqual(issuer.orders["host"], 0)


class SharedCacheBase(AcmeTestCase):
    """Routers on 127.0.0.2 and 127.0.0.3 (the same port 80) sharing one bucket. Pebble resolves
    every name to the first, so an order the second places is validated by the first, from the
    challenge the second put in the bucket."""

    KEY = base64.b64encode(bytes(range(32))).decode()

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        self.http_port = free_ports(1)[0]
        return Deferred.fromCoroutine(self._set_up())

    async def _set_up(self) -> None:
        await self._start_acme(default_ipv4="127.0.0.2")
        self.s3 = await shared_server("moto")
        self.bucket = await self.s3.new_bucket()

    def box_flags(self, box: Box) -> dict[str, str]:
        creds = self.s3.credentials
        with open(box.env, "a") as f:  # the seeds keep the bucket's credentials in the env file
            f.write(
                f"AWS_ACCESS_KEY_ID={creds.access_key}\nAWS_SECRET_ACCESS_KEY={creds.secret_key}\n"
            )
        # The router copies them into its process environment, which here is the test's: this
        # test's server's keys, and the previous environment back afterwards.
        for name, value in (
            ("AWS_ACCESS_KEY_ID", creds.access_key),
            ("AWS_SECRET_ACCESS_KEY", creds.secret_key),
        ):
            saved = os.environ.get(name)
            os.environ[name] = value
            self.addCleanup(restore_env, name, saved)
        return self.acme_flags(
            box,
            LCHAT_HIBERNATE_BUCKET=self.bucket,
            LCHAT_HIBERNATE_ENDPOINT=self.s3.endpoint,
            LCHAT_HIBERNATE_REGION=self.s3.region,
            LCHAT_HIBERNATE_PREFIX="fleet",
            LCHAT_CERT_CACHE="s3",
            LCHAT_CERT_CACHE_KEY=self.KEY,
            LCHAT_CERT_CACHE_SYNC="1s",
        )


class SharedCacheTests(SharedCacheBase):
    """On moto."""

    async def test_two_routers_share_one_issuance(self) -> None:
        a, b = Box(self, "127.0.0.2"), Box(self, "127.0.0.3")
        for box in (a, b):
            box.register(HOST)
            box.register("other.example.test")
        _, issuer_a, port_a = self.start(a.config(**self.box_flags(a)))
        _, issuer_b, port_b = self.start(b.config(**self.box_flags(b)))

        # B orders; the CA validates at A, which answers from the bucket.
        leaf_b = await self.served(port_b, HOST, "127.0.0.3")
        self.assertEqual((issuer_a.orders["host"], issuer_b.orders["host"]), (0, 1))
        # A's first contact takes it from the shared cache: the same certificate, no order.
        leaf_a = await self.served(port_a, HOST, "127.0.0.2")
        self.assertEqual(leaf_a.serial_number, leaf_b.serial_number)
        self.assertEqual(issuer_a.orders["host"], 0)

        # Both at once for another host: one order between them, one certificate served by both.
        both = await gather(
            self.served(port_a, "other.example.test", "127.0.0.2"),
            self.served(port_b, "other.example.test", "127.0.0.3"),
        )
        self.assertEqual(both[0].serial_number, both[1].serial_number)
        self.assertEqual(issuer_a.orders["host"] + issuer_b.orders["host"], 2)

        # What the bucket holds: chains in clear, private keys encrypted.
        client = self.s3.client()
        for host in (HOST, "other.example.test"):
            body = client.get_object(Bucket=self.bucket, Key=f"fleet/certs/{host}.json")[
                "Body"
            ].read()
            self.assertNotIn(b"PRIVATE KEY", body)
            key_pem, _ = split_pem(read_bytes(os.path.join(a.acme, f"{host}.pem")))
            der = serialization.load_pem_private_key(key_pem, None).private_bytes(
                serialization.Encoding.DER,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            self.assertNotIn(base64.b64encode(der), body)
            self.assertNotIn(der, body)
            entry = json.loads(body)
            self.assertEqual(entry["key"]["alg"], "AES-256-GCM")
            self.assertIn(b"BEGIN CERTIFICATE", entry["chain"].encode())

        # `lchat certs` on A: both certificates, here and in the bucket (the same ones).
        env = write_file(
            os.path.join(a.dir, "cli.env"),
            "".join(f"{k}={v}\n" for k, v in self.box_flags(a).items())
            + read_bytes(a.env).decode(),
        )
        rows = json.loads(await deferToThread(lchat_cli, "certs", "--json", "--env-file", env))
        by_name = {r["name"]: r for r in rows}
        self.assertEqual(set(by_name), {HOST, "other.example.test"})
        for row in rows:
            self.assertEqual((row["kind"], row["source"]), ("host", "dir+s3"))
            self.assertIn("Pebble", row["issuer"])
        self.assertEqual(by_name[HOST]["serial"], f"{leaf_a.serial_number:x}")
        table = await deferToThread(lchat_cli, "certs", "--env-file", env)
        self.assertIn("NOT-AFTER", table.splitlines()[0])
        self.assertIn("dir+s3", table)

    async def test_only_certificates_from_our_ca_are_shared(self) -> None:
        a = Box(self, "127.0.0.2")
        a.register(HOST)
        a.register("hand.example.test")
        now = datetime.datetime.now(datetime.UTC)
        # A file placed by hand (a dev certificate, say), valid for a year: not the fleet's.
        make_cert(a.acme, "hand.example.test", now, now + datetime.timedelta(days=365))
        service, _, port = self.start(a.config(**self.box_flags(a)))
        await self.served(port, HOST, "127.0.0.2")
        sync = service.getServiceNamed("hibernation").getServiceNamed("cert-cache")
        await sync.sync_now()
        await sync.sync_now()
        listed = await deferToThread(
            self.s3.client().list_objects_v2, Bucket=self.bucket, Prefix="fleet/certs/"
        )
        keys = {o["Key"] for o in listed.get("Contents", [])}
        self.assertIn(f"fleet/certs/{HOST}.json", keys)
        self.assertNotIn("fleet/certs/hand.example.test.json", keys)

    async def test_a_certificate_reaches_the_other_box_without_a_handshake(self) -> None:
        a, b = Box(self, "127.0.0.2"), Box(self, "127.0.0.3")
        for box in (a, b):
            box.register(HOST)
        _, issuer_a, port_a = self.start(a.config(**self.box_flags(a)))
        _, _, port_b = self.start(b.config(**self.box_flags(b)))
        leaf = await self.served(port_b, HOST, "127.0.0.3")
        # A's sync (every second here) installs it: A's very first handshake is served.
        for _ in range(100):
            if f"{HOST}.pem" in listing(a.acme):
                break
            await sleep(0.1)
        for _ in range(50):
            got = await deferToThread(handshake, port_a, HOST, self.roots, "127.0.0.2")
            if isinstance(got, x509.Certificate):
                break
            await sleep(0.1)  # the file is there; the store rescans on the sync's word
        assert isinstance(got, x509.Certificate), got
        self.assertEqual(got.serial_number, leaf.serial_number)
        self.assertEqual(issuer_a.orders["host"], 0)

    async def test_an_entry_under_another_key_is_refused(self) -> None:
        a = Box(self, "127.0.0.2")
        a.register(HOST)
        flags = self.box_flags(a)
        self.start(a.config(**flags))
        leaf = await self.served(self.start_port, HOST, "127.0.0.2")
        # A box with another key cannot decrypt the entry: it refuses it (logged) and orders.
        # Its HTTP-01 answer, MACed under its own key, is refused by A (where the CA looks): a
        # box without the fleet's key is no box of the fleet, and gets no certificate through it.
        b = Box(self, "127.0.0.3")
        b.register(HOST)
        other = {**self.box_flags(b), "LCHAT_CERT_CACHE_KEY": base64.b64encode(b"k" * 32).decode()}
        refused = REGISTRY.get_sample_value(
            "lchat_acme_challenge_lookups_total", {"outcome": "unauthenticated"}
        )
        _, issuer_b, port_b = self.start(b.config(**other))
        await deferToThread(handshake, port_b, HOST, self.roots, "127.0.0.3")  # B orders
        for _ in range(300):
            if HOST in issuer_b.status()["failing"]:
                break
            await sleep(0.1)
        self.assertEqual(issuer_b.status()["failing"][HOST]["stage"], "validation")
        self.assertEqual(issuer_b.orders["host"], 1)
        self.assertGreater(
            REGISTRY.get_sample_value(
                "lchat_acme_challenge_lookups_total", {"outcome": "unauthenticated"}
            )
            or 0.0,
            refused or 0.0,
        )
        # ...and never replaces the fleet's entry with one the fleet cannot read.
        body = self.s3.client().get_object(Bucket=self.bucket, Key=f"fleet/certs/{HOST}.json")
        entry = json.loads(body["Body"].read())
        self.assertEqual(entry["serial"], f"{leaf.serial_number:x}")
        self.assertEqual(entry["key"]["key_id"], key_id(base64.b64decode(self.KEY)))


class WildcardTests(AcmeTestCase):
    """``*.example.test`` by DNS-01: our DNSimple client talks to the API double, which writes
    the TXT records into pebble-challtestsrv, where Pebble (and our propagation check) look."""

    TOKEN = "dnsimple-test-token"

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        d = super().setUp()

        def double(_: object) -> None:
            def sink(fqdn: str, value: str, present: bool) -> None:
                if present:
                    self.dns.set_txt(fqdn, value)
                else:
                    self.dns.clear_txt(fqdn)

            self.dnsimple = DNSimpleDouble(
                token=self.TOKEN, zones=["example.test"], on_change=sink
            ).start()
            self.addCleanup(self.dnsimple.stop)

        return d.addCallback(double)

    def wildcard_flags(self, box: Box) -> dict[str, str]:
        host, port = self.dns.dns_address
        return self.acme_flags(
            box,
            LCHAT_WILDCARD_DOMAINS="example.test",
            LCHAT_DNSIMPLE_TOKEN=self.TOKEN,
            LCHAT_DNSIMPLE_URL=self.dnsimple.url,
            LCHAT_DNS_RESOLVERS=f"{host}:{port}",
            LCHAT_DNS_PROPAGATION_TIMEOUT="20s",
        )

    async def test_a_wildcard_is_issued_at_start_and_covers_every_subdomain(self) -> None:
        box = Box(self)
        box.register(HOST)
        _, issuer, port = self.start(box.config(**self.wildcard_flags(box)))
        leaf = await self.served(port, "anything.example.test")  # registered or not
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(names.get_values_for_type(x509.DNSName), ["*.example.test"])
        got = await self.served(port, HOST)
        self.assertEqual(got.serial_number, leaf.serial_number)  # no per-host order
        self.assertEqual(issuer.orders, {"host": 0, "wildcard": 1})
        self.assertIn("wildcard-example.test.pem", listing(box.acme))
        # the TXT record was added through the API and removed again
        self.assertEqual(self.dnsimple.txt_values("_acme-challenge.example.test"), [])
        self.assertEqual(len(self.dnsimple.calls("DELETE")), 1)
        self.assertEqual(self.dnsimple.sink_errors, [])

    async def test_the_txt_record_is_removed_also_when_the_order_fails(self) -> None:
        # The provider takes the record but it never reaches DNS: the propagation wait gives
        # up, the order fails, and the record is deleted through the API all the same.
        self.dnsimple.on_change = None
        box = Box(self)
        box.register(HOST)
        flags = {**self.wildcard_flags(box), "LCHAT_DNS_PROPAGATION_TIMEOUT": "1s"}
        _, issuer, _ = self.start(box.config(**flags))
        for _ in range(200):
            if issuer._wildcards.get("example.test") == "failed":
                break
            await sleep(0.1)
        self.assertEqual(issuer._failures[CertName.wildcard("example.test")][2], "dns")
        self.assertEqual(len(self.dnsimple.calls("POST")), 1)
        self.assertEqual(len(self.dnsimple.calls("DELETE")), 1)
        self.assertEqual(self.dnsimple.txt_values("_acme-challenge.example.test"), [])
        self.flushLoggedErrors()

    async def test_a_failing_dns_provider_degrades_to_per_host_certificates(self) -> None:
        self.dnsimple.fail_always(500)
        box = Box(self)
        box.register(HOST)
        _, issuer, port = self.start(box.config(**self.wildcard_flags(box)))
        for _ in range(200):
            if issuer._wildcards.get("example.test") == "failed":
                break
            await sleep(0.1)
        self.assertEqual(issuer._wildcards.get("example.test"), "failed")
        leaf = await self.served(port, HOST)  # its own certificate, by HTTP-01
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(names.get_values_for_type(x509.DNSName), [HOST])
        self.assertEqual(issuer.orders["host"], 1)
        # an unregistered subdomain still gets nothing
        self.assertIsInstance(
            await deferToThread(handshake, port, "stranger.example.test", None), str
        )
        self.flushLoggedErrors()


class SharedCacheOutageTests(SharedCacheBase):
    """The bucket vanishes after boot: TLS keeps working from the local directory, a new host is
    still issued (without the cross-box lock), and the certificate reaches the bucket once it is
    back. SeaweedFS: it keeps its data and credentials across a restart (moto keeps neither)."""

    async def _set_up(self) -> None:
        await self._start_acme(default_ipv4="127.0.0.2")
        self.s3 = await start_server("seaweedfs")
        self.addCleanup(self.s3.destroy)
        self.bucket = self.s3.bucket

    async def test_a_bucket_outage_never_breaks_tls(self) -> None:
        a = Box(self, "127.0.0.2")
        a.register(HOST)
        a.register("later.example.test")
        service, issuer, port = self.start(a.config(**self.box_flags(a)))
        first = await self.served(port, HOST, "127.0.0.2")
        # The boot probe is done (a failing one would stop the process: not what is tested here).
        await service.getServiceNamed("hibernation").check.checked
        await self.s3.stop()

        # Served as before, from the local copy.
        again = await deferToThread(handshake, port, HOST, self.roots, "127.0.0.2")
        assert isinstance(again, x509.Certificate), again
        self.assertEqual(again.serial_number, first.serial_number)
        # A host never seen before is still issued: a certificate beats a perfect single order.
        await self.served(port, "later.example.test", "127.0.0.2", within=60)
        self.assertEqual(issuer.orders["host"], 2)

        # The bucket comes back: the next sync uploads what it lacks.
        await self.s3.start()
        client = self.s3.client()
        keys: set[str] = set()
        for _ in range(100):
            listed = await deferToThread(
                client.list_objects_v2, Bucket=self.bucket, Prefix="fleet/certs/"
            )
            keys = {o["Key"] for o in listed.get("Contents", [])}
            if {f"fleet/certs/{HOST}.json", "fleet/certs/later.example.test.json"} <= keys:
                break
            await sleep(0.2)
        self.assertIn(f"fleet/certs/{HOST}.json", keys)
        self.assertIn("fleet/certs/later.example.test.json", keys)
        self.flushLoggedErrors()

"""A real ACME CA for tests: Pebble, with pebble-challtestsrv as its DNS, on free loopback ports.

Reusable by any test that needs certificates issued over ACME (HTTP-01 through a router, DNS-01
through a DNS provider that is really challtestsrv):

    pebble, dns = start_acme_sync(http_port)   # or: await start_acme(http_port, ...)
    # the caller cleans up: addCleanup(pebble.destroy); addCleanup(dns.destroy) (atexit does too)
    pebble.directory_url     # "https://127.0.0.1:<port>/dir", the ACME directory
    pebble.ca_file           # trust this for the ACME API (requests ``verify=``); not the issuing root
    pebble.roots_pem()       # the root that signs issued certificates (new on every Pebble start)
    pebble.intermediates_pem()
    dns.set_txt("_acme-challenge.example.test", value); dns.clear_txt("_acme-challenge.example.test")
    dns.add_a("www.example.test", ["127.0.0.2"]); dns.set_default_ipv4("127.0.0.1")
    dns.dns_address          # ("127.0.0.1", port): UDP and TCP, for a resolver checking propagation

Pebble validates HTTP-01 by resolving the name through challtestsrv (every name without an explicit
A record answers ``default_ipv4``; AAAA answers nothing) and fetching
``http://<ip>:<http_port>/.well-known/acme-challenge/<token>``: the test binds ``http_port`` on that
address (``start_acme_sync`` takes it because Pebble's config fixes it at start). Pebble 2.4 makes
each validation three times at once ("Starting 3 validations"), so the responder sees three
concurrent identical GETs (or TXT lookups) and all must succeed. DNS-01 TXT records are looked up
at challtestsrv. TLS-ALPN-01 goes to a port nobody listens on. With ``validity_seconds=N`` an
issued certificate has ``notAfter = notBefore + N - 1 s`` (inclusive); the default is 5 years.
A whole issuance takes about 1.2 s, most of it the ``acme`` library's own 1 s sleep.

Pebble runs with ``PEBBLE_VA_NOSLEEP=1`` (validation at once, not after 0-15 s),
``PEBBLE_WFE_NONCEREJECT=0`` (no random badNonce) and ``PEBBLE_AUTHZREUSE=0`` (an order's
authorizations are nearly always pending and validated afresh: a reused valid one was seen once in
a full run, so a test that needs a fresh validation orders a name of its own); any other ``PEBBLE_*`` variable of the calling
environment is dropped (``PEBBLE_VA_ALWAYS_VALID`` would make every test pass). Pebble has no test
certificate of its own here: the harness makes a throwaway CA and a leaf for ``127.0.0.1`` and
``localhost`` per server (``ca_file``). Both servers keep everything in memory: a restart
(``stop``/``start``, same ports) forgets accounts, orders and records, and Pebble makes new roots.

Management-API notes (pebble-challtestsrv 2.4.0, checked against the binary): ``/set-txt`` *adds*
a value (two calls give two TXT records) and ``/clear-txt`` removes every value of the name; TXT
names match only as fully qualified (trailing dot; ``set_txt`` adds it) while A names are
normalised by the server. Each call answers 200 with an empty body, 400 on a bad body (raised
here as ``RuntimeError``); the endpoints of the disabled HTTP-01/TLS-ALPN-01 servers are 404.
Pebble's own management interface is HTTPS with the ``ca_file`` certificate, like its ACME API.

Everything blocking (spawning, polling, management calls) has a synchronous form (``*_sync`` for
process control, usable from ``setUpClass``-like code and ``atexit``) and, for process control, an
async form that runs it in the reactor's thread pool. Management calls are plain loopback HTTP that
return in a millisecond or so; call them from the reactor thread or a worker as convenient.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import dns.exception
import dns.message
import dns.query
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import reactor as _reactor
from twisted.internet.threads import deferToThreadPool

from tests.s3servers import ServerLifecycle, free_ports, port_answers

START_TIMEOUT = 30.0
REQUEST_TIMEOUT = 10.0
HOST = "127.0.0.1"


def _pebble_bin() -> str:
    path = shutil.which("pebble")
    if path is None:
        raise RuntimeError("pebble is not installed: apt-get install pebble")
    return path


def _challtestsrv_bin() -> str:
    path = shutil.which("pebble-challtestsrv")
    if path is None:
        raise RuntimeError("pebble-challtestsrv is not installed: apt-get install pebble")
    return path


def _udp_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _opener(ca_file: str | None = None) -> urllib.request.OpenerDirector:
    """urllib without proxies (a CI's HTTPS_PROXY must not see loopback), trusting ``ca_file``."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ca_file is not None:
        handlers.append(
            urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_file))
        )
    return urllib.request.build_opener(*handlers)


# -- every server this process started, killed at exit ------------------------------------------

_live: set[_Server] = set()
_live_lock = threading.Lock()


@atexit.register
def _destroy_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.destroy_sync()


class _Server(ServerLifecycle):
    """One child process in its own process group, logging to ``<dir>/server.log``."""

    name = "server"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"lchat-{self.name}-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._destroyed = False
        with _live_lock:
            _live.add(self)

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start_sync(self) -> None:
        """Spawn the server (no-op if running) and wait, up to 30 s, until it serves."""
        if self._destroyed:
            raise RuntimeError(f"this {self.name} was destroyed")
        if self.running:
            return
        argv = self._argv()
        log = open(os.path.join(self.dir, "server.log"), "ab")  # the child inherits it
        try:
            self._proc = subprocess.Popen(
                argv,
                cwd=self.dir,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills everything it forked
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop_sync()
                raise RuntimeError(f"{self.name} did not start ({' '.join(argv)}):\n{tail}")
            time.sleep(0.05)

    def stop_sync(self) -> None:
        """SIGKILL the server's process group (all state is lost). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def destroy_sync(self) -> None:
        """Stop and remove the directory; the object cannot be started again. Idempotent."""
        self.stop_sync()
        self._destroyed = True
        shutil.rmtree(self.dir, ignore_errors=True)
        with _live_lock:
            _live.discard(self)


# -- pebble-challtestsrv: the DNS Pebble resolves with -------------------------------------------


def _fqdn(name: str) -> str:
    return name.lower().rstrip(".") + "."


class ChallTestSrv(_Server):
    """pebble-challtestsrv with only its mock DNS (UDP and TCP) and its management API.

    Names without an explicit A record answer ``default_ipv4``; AAAA queries answer nothing (so a
    validator that prefers IPv6 still dials ``default_ipv4``).
    """

    name = "challtestsrv"

    def __init__(self, default_ipv4: str = "127.0.0.1") -> None:
        super().__init__()
        self.default_ipv4 = default_ipv4
        self.dns_port, self.management_port = self._ports()
        self.dns_address: tuple[str, int] = (HOST, self.dns_port)
        self.management_url = f"http://{HOST}:{self.management_port}"

    def __repr__(self) -> str:
        return f"<ChallTestSrv dns={HOST}:{self.dns_port} {self.management_url} running={self.running}>"

    @staticmethod
    def _ports() -> tuple[int, int]:
        # The DNS port serves UDP and TCP: free_ports checks TCP only, so check UDP too.
        for _ in range(50):
            dns_port, management = free_ports(2)
            if _udp_free(dns_port):
                return dns_port, management
        raise RuntimeError("no loopback port free for both UDP and TCP")

    def _argv(self) -> list[str]:
        return [
            _challtestsrv_bin(),
            "-dns01",
            f"{HOST}:{self.dns_port}",
            "-management",
            f"{HOST}:{self.management_port}",
            "-http01",
            "",
            "-https01",
            "",
            "-tlsalpn01",
            "",
            "-defaultIPv4",
            self.default_ipv4,
            "-defaultIPv6",
            "",  # accepted: AAAA queries get an empty answer
        ]

    def _ready(self) -> bool:
        if not (port_answers(self.management_port) and port_answers(self.dns_port)):
            return False
        try:  # the UDP listener is a separate goroutine from the TCP one
            dns.query.udp(
                dns.message.make_query("ready.test.", "A"), HOST, timeout=0.5, port=self.dns_port
            )
        except (OSError, dns.exception.DNSException):
            return False
        return True

    # -- management API (POST, JSON body; 200 and an empty body on success) -----------------------

    def _post(self, path: str, body: dict[str, Any]) -> None:
        req = urllib.request.Request(  # noqa: S310  (http on loopback, a URL we built)
            f"{self.management_url}/{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with _opener().open(req, timeout=REQUEST_TIMEOUT) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace").strip()
            raise RuntimeError(f"challtestsrv /{path} {body!r}: HTTP {e.code} {detail}") from e

    def set_txt(self, fqdn: str, value: str) -> None:
        """Add ``value`` to the TXT records of ``fqdn`` (values accumulate until :meth:`clear_txt`)."""
        self._post("set-txt", {"host": _fqdn(fqdn), "value": value})

    def clear_txt(self, fqdn: str) -> None:
        """Remove every TXT value of ``fqdn``."""
        self._post("clear-txt", {"host": _fqdn(fqdn)})

    def add_a(self, host: str, ips: list[str]) -> None:
        """Answer A queries for ``host`` with ``ips`` instead of the default."""
        self._post("add-a", {"host": _fqdn(host), "addresses": list(ips)})

    def clear_a(self, host: str) -> None:
        """Back to the default address for ``host``."""
        self._post("clear-a", {"host": _fqdn(host)})

    def set_default_ipv4(self, ip: str) -> None:
        """The answer to A queries for names without their own record (``""``: no answer)."""
        self._post("set-default-ipv4", {"ip": ip})
        self.default_ipv4 = ip  # so a restart keeps it


# -- Pebble ---------------------------------------------------------------------------------------


def _write_tls_files(directory: str) -> tuple[str, str, str]:
    """A throwaway CA and a leaf for 127.0.0.1 and localhost: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=30)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lchat test Pebble API CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.IPv4Address(HOST)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = tuple(os.path.join(directory, n) for n in ("ca.pem", "cert.pem", "key.pem"))
    ca_path, cert_path, key_path = paths
    with open(ca_path, "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(cert_path, "wb") as f:
        f.write(leaf.public_bytes(serialization.Encoding.PEM))
    with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return ca_path, cert_path, key_path


class Pebble(_Server):
    """One Pebble process resolving names through ``dns`` and validating HTTP-01 on ``http_port``.

    ``ca_file`` signs Pebble's own API and management certificates (what an ACME client trusts);
    :meth:`roots_pem` is the root of the certificates it issues, a fresh key on every start.
    ``validity_seconds`` sets the issued certificates' lifetime (Pebble's default: 5 years).
    """

    name = "pebble"

    def __init__(
        self, http_port: int, dns: ChallTestSrv, *, validity_seconds: int | None = None
    ) -> None:
        super().__init__()
        self.http_port = http_port
        self.dns = dns
        self.validity_seconds = validity_seconds
        self.port, self.management_port, self.tls_port = free_ports(3)
        self.directory_url = f"https://{HOST}:{self.port}/dir"
        self.management_url = f"https://{HOST}:{self.management_port}"
        self.ca_file, cert, key = _write_tls_files(self.dir)
        config: dict[str, Any] = {
            "listenAddress": f"{HOST}:{self.port}",
            "managementListenAddress": f"{HOST}:{self.management_port}",
            "certificate": cert,
            "privateKey": key,
            "httpPort": http_port,
            "tlsPort": self.tls_port,  # TLS-ALPN-01 validation: nobody listens there
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
        if validity_seconds is not None:
            config["certificateValidityPeriod"] = validity_seconds
        self.config_file = os.path.join(self.dir, "pebble-config.json")
        with open(self.config_file, "w") as f:
            json.dump({"pebble": config}, f, indent=2)

    def __repr__(self) -> str:
        return f"<Pebble {self.directory_url} http_port={self.http_port} running={self.running}>"

    def _argv(self) -> list[str]:
        return [
            _pebble_bin(),
            "-config",
            self.config_file,
            "-dnsserver",
            f"{self.dns.dns_address[0]}:{self.dns.dns_address[1]}",
        ]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEBBLE_")}
        env.update(PEBBLE_VA_NOSLEEP="1", PEBBLE_WFE_NONCEREJECT="0", PEBBLE_AUTHZREUSE="0")
        return env

    def _get(self, url: str) -> str:
        with _opener(self.ca_file).open(url, timeout=REQUEST_TIMEOUT) as resp:
            body: bytes = resp.read()
        return body.decode()

    def _ready(self) -> bool:
        # The ACME API and the management interface are separate listeners: wait for both.
        for url in (self.directory_url, f"{self.management_url}/roots/0"):
            try:
                self._get(url)
            except (OSError, urllib.error.URLError):
                return False
        return True

    def roots_pem(self) -> str:
        """PEM of the root that (through :meth:`intermediates_pem`) signs issued certificates."""
        return self._get(f"{self.management_url}/roots/0")

    def intermediates_pem(self) -> str:
        """PEM of the intermediate that signs issued certificates (the chain's second element)."""
        return self._get(f"{self.management_url}/intermediates/0")


# -- both at once ---------------------------------------------------------------------------------


def start_acme_sync(
    http_port: int, *, default_ipv4: str = "127.0.0.1", validity_seconds: int | None = None
) -> tuple[Pebble, ChallTestSrv]:
    """A started challtestsrv and a started Pebble using it as DNS. The caller destroys both
    (``pebble.destroy_sync(); dns.destroy_sync()``); whatever is left is killed at exit."""
    chall = ChallTestSrv(default_ipv4)
    pebble: Pebble | None = None
    try:
        chall.start_sync()
        pebble = Pebble(http_port, chall, validity_seconds=validity_seconds)
        pebble.start_sync()
    except BaseException:
        if pebble is not None:
            pebble.destroy_sync()
        chall.destroy_sync()
        raise
    return pebble, chall


async def start_acme(
    http_port: int, *, default_ipv4: str = "127.0.0.1", validity_seconds: int | None = None
) -> tuple[Pebble, ChallTestSrv]:
    """:func:`start_acme_sync` in the reactor's thread pool (e.g. ``self.addCleanup(pebble.destroy)``)."""
    reactor: Any = _reactor
    result: tuple[Pebble, ChallTestSrv] = await deferToThreadPool(
        reactor,
        reactor.getThreadPool(),
        lambda: start_acme_sync(
            http_port, default_ipv4=default_ipv4, validity_seconds=validity_seconds
        ),
    )
    return result

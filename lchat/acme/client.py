"""The ACME account and one order, on certbot's ``acme`` library (txacme is dead).

Everything here blocks (the library speaks ``requests``): it runs in worker threads only, and the
issuer (:mod:`lchat.acme.issuer`) hands it a deadline. The account key is created once and kept in
the certificate directory (``acme-account.key``, mode 0600: the TLS scanner ignores the name); the
registration is looked up (or made) once per process, on the first order, so a router that never
needs a certificate never talks to the CA.

A certificate's private key is a fresh ECDSA P-256 key per order (small, fast handshakes); the
result is the key and the chain, leaf first: exactly what a ``<host>.pem`` file holds.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import josepy as jose
import requests
from acme import challenges, client, crypto_util, errors, messages
from attrs import frozen
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from twisted.logger import Logger

import lchat
from lchat.backoff import Backoff
from lchat.files import write_atomic

ACCOUNT_KEY_FILE = "acme-account.key"
USER_AGENT = f"lchat/{lchat.__version__}"
# How often we look at a pending authorization, and at an order being finalized: at once, then
# a short, growing delay (the library's own poll waits a whole second before its first look).
VALIDATION_POLL = Backoff(0.02, 2.0)
FINALIZE_POLL = Backoff(0.05, 2.0)

_log = Logger(namespace="lchat.acme")


class IssuanceError(Exception):
    """An order that did not produce a certificate. ``stage`` is a small fixed set (metric
    label): ``account``, ``order``, ``challenge``, ``dns``, ``validation``, ``finalize``,
    ``network``, ``stopped``."""

    def __init__(self, stage: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.retry_after = retry_after  # the CA asked us to wait this long (rate limits)


@frozen
class Issued:
    key_pem: bytes
    chain_pem: bytes  # leaf first


class Solver(Protocol):
    """One way of proving control of a name; called in the worker thread."""

    kind: str  # "http-01" or "dns-01"

    def present(self, domain: str, token: str, validation: str) -> object:
        """Make the proof visible (the HTTP-01 key authorisation, or the DNS-01 TXT value);
        return a handle for :meth:`cleanup`."""

    def ready(self, handles: Sequence[object]) -> None:
        """Block until every proof is visible to the CA (DNS propagation); may raise."""

    def cleanup(self, handle: object) -> None:
        """Take a proof away again. Called for every handle, also when the order failed."""


class AcmeAccount:
    """One ACME account at ``directory_url``, its key kept in ``cache_dir``. Thread-safe."""

    def __init__(
        self,
        directory_url: str,
        cache_dir: str,
        *,
        email: str = "",
        ca_file: str = "",
        timeout: int = 30,
    ) -> None:
        self.directory_url = directory_url
        self.cache_dir = cache_dir
        self._email = email
        self._verify: bool | str = ca_file or True
        self._timeout = timeout
        self._lock = threading.Lock()
        self._client: client.ClientV2 | None = None
        self._key: jose.JWKRSA | None = None
        self.stopping = threading.Event()

    @property
    def key_path(self) -> str:
        return os.path.join(self.cache_dir, ACCOUNT_KEY_FILE)

    # -- the account ------------------------------------------------------------------------

    def connect(self) -> tuple[client.ClientV2, jose.JWKRSA]:
        """The registered client (registering on first use). Blocking."""
        with self._lock:
            if self._client is None or self._key is None:
                key = jose.JWKRSA(key=self._load_or_create_key())
                try:
                    self._client = self._register(key)
                except errors.Error as e:
                    raise IssuanceError("account", f"cannot register with the CA: {e}") from e
                except messages.Error as e:
                    raise IssuanceError(
                        "account", f"the CA refused the account: {_problem(e)}"
                    ) from e
                except requests.RequestException as e:
                    raise IssuanceError(
                        "network", f"cannot reach {self.directory_url}: {_short(e)}"
                    ) from e
                self._key = key
            return self._client, self._key

    def _register(self, key: jose.JWKRSA) -> client.ClientV2:
        net = client.ClientNetwork(
            key,
            verify_ssl=self._verify,  # type: ignore[arg-type]  # requests takes a CA bundle path too
            user_agent=USER_AGENT,
            timeout=self._timeout,
        )
        directory = client.ClientV2.get_directory(self.directory_url, net)
        acme = client.ClientV2(directory, net)
        registration = messages.NewRegistration.from_data(
            email=self._email or None, terms_of_service_agreed=True
        )
        try:
            regr = acme.new_account(registration)
            _log.info(
                "acme: registered account {uri} at {directory}",
                uri=regr.uri,
                directory=self.directory_url,
            )
        except errors.ConflictError as e:
            # The key is already registered: that account is ours.
            net.account = messages.RegistrationResource(
                uri=e.location, body=messages.Registration()
            )
            _log.info("acme: using account {uri}", uri=e.location)
        return acme

    def _load_or_create_key(self) -> rsa.RSAPrivateKey:
        path = self.key_path
        if not os.path.exists(path):
            created = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            write_atomic(path, _pem(created), 0o600)
            _log.info("acme: created the account key {path}", path=path)
        # Another process may have won the race to create it: whoever is on disk is the account.
        with open(path, "rb") as f:
            loaded = serialization.load_pem_private_key(f.read(), password=None)
        if not isinstance(loaded, rsa.RSAPrivateKey):
            raise IssuanceError("account", f"{path} is not an RSA key")
        return loaded

    # -- one order --------------------------------------------------------------------------

    def issue(
        self,
        names: Sequence[str],
        solver: Solver,
        *,
        deadline: float,  # seconds for validation and finalisation
        on_order: Callable[[], None],  # called once the CA has the order
    ) -> Issued:
        """Order a certificate for ``names`` (``*.domain`` for a wildcard), prove control with
        ``solver``, and return it. Blocking; raises :class:`IssuanceError`."""
        acme, key = self.connect()
        self.sleep(0)
        key_pem = _pem(ec.generate_private_key(ec.SECP256R1()))
        csr = crypto_util.make_csr(key_pem, list(names))
        try:
            order = acme.new_order(csr)
        except messages.Error as e:
            self._forget_account_on(e)
            raise IssuanceError("order", _problem(e), _retry_after(e)) from e
        except requests.RequestException as e:
            raise IssuanceError("network", f"new order: {_short(e)}") from e
        on_order()
        handles: list[object] = []
        try:
            answers = []
            for authz in order.authorizations:
                if authz.body.status == messages.STATUS_VALID:
                    continue  # the CA remembers an earlier validation
                domain = authz.body.identifier.value
                challb = _pick(authz.body.challenges, solver.kind, domain)
                if isinstance(challb.chall, challenges.DNS01):
                    proof = challb.chall.validation(key)
                else:
                    proof = challb.chall.response_and_validation(key)[1]
                handles.append(solver.present(domain, challb.chall.encode("token"), proof))
                answers.append(challb)
            self.sleep(0)
            solver.ready(handles)
            self.sleep(0)
            for challb in answers:
                acme.answer_challenge(challb, challb.chall.response(key))
            until = datetime.datetime.now() + datetime.timedelta(seconds=deadline)
            self._wait_validated(acme, order, until)
            order = acme.poll_authorizations(order, until)  # all valid by now: no wait
            order = self._finalize(acme, order, until)
        except errors.ValidationError as e:
            raise IssuanceError("validation", _validation_errors(e)) from e
        except errors.TimeoutError as e:
            raise IssuanceError("validation", f"not validated within {deadline:.0f}s") from e
        except messages.Error as e:
            self._forget_account_on(e)
            raise IssuanceError("finalize", _problem(e), _retry_after(e)) from e
        except requests.RequestException as e:
            raise IssuanceError("network", _short(e)) from e
        except errors.Error as e:
            raise IssuanceError("finalize", str(e) or type(e).__name__) from e
        finally:
            for handle in handles:
                try:
                    solver.cleanup(handle)
                except Exception as e:
                    _log.warn(
                        "acme: cleaning up a {kind} proof failed: {error}",
                        kind=solver.kind,
                        error=e,
                    )
        chain = order.fullchain_pem.encode("ascii")
        x509.load_pem_x509_certificate(chain)  # a chain that does not parse fails the order here
        return Issued(key_pem, chain)

    def _wait_validated(
        self, acme: client.ClientV2, order: messages.OrderResource, until: datetime.datetime
    ) -> None:
        for authz in order.authorizations:
            delays = VALIDATION_POLL.delays()
            while acme.poll(authz)[0].body.status == messages.STATUS_PENDING:
                if datetime.datetime.now() >= until:
                    return  # poll_and_finalize reports the timeout
                self.sleep(delays.next())

    def _finalize(
        self, acme: client.ClientV2, order: messages.OrderResource, until: datetime.datetime
    ) -> messages.OrderResource:
        """Finalize and fetch the chain, polling the order by FINALIZE_POLL."""
        order = acme.begin_finalization(order)
        post_as_get = getattr(acme, "_post_as_get", None)  # the library's POST-as-GET
        delays = FINALIZE_POLL.delays()
        while post_as_get is not None and datetime.datetime.now() < until:
            body = order.body
            if body.status == messages.STATUS_VALID and body.certificate is not None:
                chain = post_as_get(body.certificate)
                return order.update(fullchain_pem=chain.text)
            if body.status == messages.STATUS_INVALID:
                problem = body.error
                raise IssuanceError(
                    "finalize",
                    _problem(problem) if problem is not None else "the CA refused the order",
                )
            if body.status != messages.STATUS_PROCESSING:
                break  # anything unusual: the library's own loop knows every case
            self.sleep(delays.next())
            response = post_as_get(order.uri)
            order = order.update(body=messages.Order.from_json(response.json()))
        try:
            return acme.poll_finalization(order, until)
        except errors.TimeoutError as e:
            raise IssuanceError("finalize", "the CA did not issue it in time") from e

    def _forget_account_on(self, e: messages.Error) -> None:
        # The CA no longer knows the account (deactivated, or a test CA restarted): register
        # again at the next order rather than failing every order until a restart.
        if (e.typ or "").endswith((":accountDoesNotExist", ":unauthorized")):
            with self._lock:
                self._client = None
                self._key = None
            _log.warn(
                "acme: the CA refused our account ({problem}); registering again at the next "
                "order (if the account was deactivated, move {key} away to make a new one)",
                problem=_problem(e),
                key=self.key_path,
            )

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (0: only look); :class:`IssuanceError` ``stopped`` once the router is
        stopping. Blocking: the order's waits, the DNS-01 propagation wait's too."""
        if self.stopping.wait(seconds):
            raise IssuanceError("stopped", "the router is stopping")


def _pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pick(
    offered: Sequence[messages.ChallengeBody], kind: str, domain: str
) -> messages.ChallengeBody:
    for challb in offered:
        if challb.chall.typ == kind:
            return challb
    kinds = ", ".join(sorted(str(c.chall.typ) for c in offered)) or "none"
    raise IssuanceError("challenge", f"the CA offers no {kind} challenge for {domain} ({kinds})")


def _problem(e: messages.Error) -> str:
    code = (e.typ or "").rsplit(":", 1)[-1]
    return f"{code}: {e.detail}" if e.detail else code or str(e)


def _retry_after(e: messages.Error) -> float | None:
    # rateLimited problems carry no Retry-After we can see here; back off hard ourselves.
    return 3 * 3600.0 if (e.typ or "").endswith(":rateLimited") else None


def _validation_errors(e: errors.ValidationError) -> str:
    parts = []
    for authzr in e.failed_authzrs:
        for challb in authzr.body.challenges:
            if challb.error is not None:
                parts.append(f"{authzr.body.identifier.value}: {_problem(challb.error)}")
    return "; ".join(parts) or "validation failed"


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 300 else text[:300] + "..."

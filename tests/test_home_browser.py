"""A real browser signs up to home and logs in, through the router over HTTPS (issue 19).

Debian's Chromium, headless, with the DevTools protocol's **virtual authenticator** (a CTAP2
platform authenticator with resident keys and user verification, presence simulated): the page
itself runs the whole flow with ``fetch`` and ``navigator.credentials`` — register a passkey, mint a
link token, write the vault, read it back; then log in with the passkey (a discoverable credential,
no username), mint a second token and read the same bytes. What this proves that the software
authenticator of ``tests/test_home.py`` cannot: home's options JSON is what a real browser's
``PublicKeyCredential.parse*OptionsFromJSON`` accepts, a real browser's ``toJSON()`` verifies, the
origin and relying party line up behind the router's HTTPS listener, and the answers' content types
work for ``fetch``.

The pieces are real processes: ``twistd lchat`` (HTTPS on 127.0.0.x with a certificate from
``lchat.cli.dev_cert``), ``twistd lchat-home`` (SQLite) behind it, registered with ``lchat
add-service``, and Chromium resolving ``home.browser.test`` to the router's address.

**Certificate trust.** The router serves ``HOST``'s certificate from a throwaway dev CA, and
Chromium must accept it without ``--ignore-certificate-errors``, which would accept *any*
certificate (Chromium 156 then still allows passkeys, but the test would no longer check that
the router served the right one). Chromium is started with
``--ignore-certificate-errors-spki-list=<base64 SHA-256 of the leaf's SubjectPublicKeyInfo>``: a
chain that does not verify is accepted as if it did only when one of its keys is that one, so the
router must have served ``HOST``'s certificate (chosen by SNI), and the page is a secure context with
no certificate error, as with a trusted CA. Chromium honours the flag only beside an explicit
``--user-data-dir`` (a fresh one per test). Also seen to work, not used because it needs
``certutil`` (libnss3-tools): the dev CA imported with ``certutil -A -t C,,`` into
``$HOME/.pki/nssdb`` of Chromium's ``HOME``. Without either, navigation fails with
``net::ERR_CERT_AUTHORITY_INVALID``.

Without Chromium (``apt-get install -y chromium`` as root; ``.ci/run`` tries to) the test is
skipped with a loud reason: the browser test of issue 19 then did not run.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from lchat.admin_client import UnixHTTPConnection, Unreachable
from lchat.cli.dev_cert import make_dev_certs
from tests.routerproc import spawn_router
from tests.test_home import Home

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "home.browser.test"
ADDRESS = "127.0.0.7"  # the router's HTTPS listener; Chromium maps HOST here
NO_CHROMIUM = (
    "THE REAL-BROWSER TEST OF ISSUE 19 DID NOT RUN: Debian's Chromium is not installed "
    "(no `chromium` on PATH). Install it as root with `apt-get install -y chromium` "
    "(.ci/run tries to when it runs as root with apt-get)."
)
# Chromium must not reach out to Google on a closed network (and must not wait for it).
QUIET = [
    "--headless",
    "--no-sandbox",  # we run as root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--password-store=basic",
]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
        return port


def spki_sha256(pem_path: str) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)) of the certificate in ``pem_path`` (the router's file
    holds the key, then the certificate): the form ``--ignore-certificate-errors-spki-list`` takes."""
    with open(pem_path, "rb") as f:
        pem = f.read()
    start = pem.index(b"-----BEGIN CERTIFICATE-----")
    cert = x509.load_pem_x509_certificate(pem[start:])
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


class DevTools:
    """One DevTools protocol session: JSON commands over a websocket (wsproto on a blocking
    socket, used from one thread). :meth:`call` returns the command's ``result`` and raises
    :class:`DevToolsError` for its ``error``; events in between are dropped."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        self._sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._events: deque[Event] = deque()
        self._text: list[str] = []
        self._next_id = 0
        self._sock.sendall(self._ws.send(Request(host=parts.netloc, target=parts.path)))
        while True:
            event = self._event()
            if isinstance(event, AcceptConnection):
                break
            if isinstance(event, RejectConnection):
                raise DevToolsError(f"the DevTools websocket was refused: {event.status_code}")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        command = {"id": ident, "method": method, "params": params}
        self._sock.sendall(self._ws.send(TextMessage(data=json.dumps(command))))
        while True:
            message = self._message()
            if message.get("id") != ident:
                continue  # an event, or a late answer to nothing we wait for
            if "error" in message:
                raise DevToolsError(f"{method}: {message['error']}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def close(self) -> None:
        with contextlib.suppress(OSError, LocalProtocolError):  # the browser may be gone already
            self._sock.sendall(self._ws.send(CloseConnection(code=1000)))
        self._sock.close()

    def _message(self) -> dict[str, Any]:
        while True:
            event = self._event()
            if isinstance(event, Message):
                self._text.append(str(event.data))
                if event.message_finished:
                    text, self._text = "".join(self._text), []
                    message: dict[str, Any] = json.loads(text)
                    return message
            elif isinstance(event, Ping):
                self._sock.sendall(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                raise DevToolsError(f"the browser closed the DevTools websocket: {event.reason}")

    def _event(self) -> Event:
        while not self._events:
            data = self._sock.recv(1 << 16)
            if not data:
                raise DevToolsError("the browser closed the DevTools connection")
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())
        return self._events.popleft()


class DevToolsError(Exception):
    pass


class Chromium:
    """A headless Chromium in its own process group, a fresh profile, and its DevTools port."""

    def __init__(self, executable: str, directory: str, flags: list[str]) -> None:
        self.profile = os.path.join(directory, "profile")
        os.makedirs(self.profile)
        self.log_path = os.path.join(directory, "chromium.log")
        env = dict(os.environ, HOME=directory)  # nothing of the real user's profile or NSS db
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    executable,
                    *QUIET,
                    f"--user-data-dir={self.profile}",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",  # it writes the port it chose to DevToolsActivePort
                    *flags,
                    "about:blank",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its zygote and renderers share the group: killed together
            )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def page(self, timeout: float = 60.0) -> DevTools:
        """A DevTools session on the tab it opened."""
        deadline = time.monotonic() + timeout
        active = os.path.join(self.profile, "DevToolsActivePort")
        while True:
            if self.proc.poll() is not None:
                raise DevToolsError(f"chromium exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with open(active) as f:
                    port = int(f.readline().strip())
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    return DevTools(pages[0]["webSocketDebuggerUrl"], timeout=timeout)
            except (OSError, ValueError):
                pass  # not written yet, or not listening yet
            if time.monotonic() > deadline:
                raise DevToolsError(f"no DevTools page within {timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the whole group, SIGKILL what is left after 10 s: no browser outlives a test."""
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()  # reap the leader so that it does not linger as a zombie
                time.sleep(0.05)
        self.proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Router:
    """``twistd lchat`` with HTTPS on ``address:port`` for HOST (a dev-cert certificate), the
    access log on, no spaces."""

    def __init__(self, root: str, address: str, port: int) -> None:
        self.dir = os.path.join(root, "router")
        self.data = os.path.join(self.dir, "data")
        self.run = os.path.join(self.dir, "run")
        os.makedirs(os.path.join(self.data, "acme"), mode=0o700)
        os.makedirs(self.run)
        self.env_file = os.path.join(self.dir, "router.env")
        self.log_path = os.path.join(self.dir, "router.log")
        self.admin = os.path.join(self.run, "router.sock")
        settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run,
            "LCHAT_HTTP_ADDR": "off",
            "LCHAT_HTTPS_ADDR": f"{address}:{port}",
            "LCHAT_UNITS": "builtin",
            "LCHAT_ACCESS_LOG": "on",
        }
        with open(self.env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in settings.items())
        self.proc: subprocess.Popen[bytes] | None = None

    def certificate(self, certs: str) -> str:
        """A dev CA in ``certs`` and HOST's certificate in the router's store; returns its path."""
        make_dev_certs(certs, [HOST])
        target = os.path.join(self.data, "acme", f"{HOST}.pem")
        shutil.copy(os.path.join(certs, f"{HOST}.pem"), target)
        os.chmod(target, 0o600)
        return target

    def start(self) -> None:
        self.proc = spawn_router(self.env_file, self.log_path)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def ready(self) -> bool:
        try:
            conn = UnixHTTPConnection(self.admin, timeout=5)
            try:
                conn.request("GET", "/status")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except (OSError, Unreachable):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def lchat(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run(
        [sys.executable, "-m", "lchat.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# The page's part: everything a home web client does, with fetch and navigator.credentials.
# __VAULT__ is replaced by the base64 of the bytes to store. Returns JSON for the test to check.
FLOW = r"""
(async () => {
  const b64 = (bytes) => btoa(String.fromCharCode(...new Uint8Array(bytes)));
  const call = async (method, path, {json, bytes, token, headers} = {}) => {
    const init = {method, headers: {...(headers || {})}};
    if (json !== undefined) {
      init.body = JSON.stringify(json);
      init.headers['Content-Type'] = 'application/json';
    }
    if (bytes !== undefined) {
      init.body = bytes;
      init.headers['Content-Type'] = 'application/octet-stream';
    }
    if (token) init.headers['Authorization'] = 'Bearer ' + token;
    const response = await fetch(path, init);
    const type = response.headers.get('content-type') || '';
    const etag = response.headers.get('etag');
    if (!response.ok) {
      throw new Error(`${method} ${path}: ${response.status} ${await response.text()}`);
    }
    if (type.startsWith('application/json')) return {body: await response.json(), etag, type};
    return {bytes: b64(await response.arrayBuffer()), etag, type};
  };
  const out = {origin: location.origin, secure: window.isSecureContext};

  // Sign up: a new account and its passkey, a link token, the first vault.
  const register = (await call('POST', '/api/register/begin', {json: {label: 'chromium'}})).body;
  const created = await navigator.credentials.create(
    {publicKey: PublicKeyCredential.parseCreationOptionsFromJSON(register.options)});
  out.created = created.toJSON();
  const account = (await call(
    'POST', '/api/register/finish?session=' + encodeURIComponent(register.session),
    {json: {credential: out.created}})).body;
  out.account = account;
  const first = (await call('POST', '/api/tokens', {json: {proof: account.proof}})).body;
  out.first = {uid: first.uid, device: first.device};
  const vault = Uint8Array.from(atob('__VAULT__'), (c) => c.charCodeAt(0));
  out.put = (await call('PUT', '/api/vault',
    {bytes: vault, token: first.token, headers: {'If-None-Match': '*'}}));
  out.read = await call('GET', '/api/vault', {token: first.token});

  // Log in again with the passkey alone (discoverable: no username), as a new device would.
  const login = (await call('POST', '/api/login/begin', {json: {}})).body;
  const asserted = await navigator.credentials.get(
    {publicKey: PublicKeyCredential.parseRequestOptionsFromJSON(login.options)});
  out.asserted = asserted.toJSON();
  const again = (await call(
    'POST', '/api/login/finish?session=' + encodeURIComponent(login.session),
    {json: {credential: out.asserted}})).body;
  out.login = again;
  const second = (await call('POST', '/api/tokens', {json: {proof: again.proof}})).body;
  out.second = {uid: second.uid, device: second.device};
  out.reread = await call('GET', '/api/vault', {token: second.token});
  out.devices = (await call('GET', '/api/devices', {token: second.token})).body;
  return JSON.stringify(out);
})()
"""


class BrowserTests(TestCase):
    timeout = 180

    def setUp(self) -> None:
        chromium = shutil.which("chromium")
        if chromium is None:
            raise SkipTest(NO_CHROMIUM)
        self.chromium = chromium
        self.root = tempfile.mkdtemp(prefix="home-browser", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)

    @inlineCallbacks
    def wait_for(self, what: str, predicate: Any, logs: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while not (yield deferToThread(predicate)):
            if time.monotonic() > deadline:
                self.fail(f"{what} within {timeout} s:\n{logs()}")
            yield deferToThread(time.sleep, 0.1)

    @inlineCallbacks
    def test_chromium_registers_and_logs_in_through_the_router(self) -> Any:
        port = free_port(ADDRESS)
        origin = f"https://{HOST}:{port}"
        router = Router(self.root, ADDRESS, port)
        leaf = router.certificate(os.path.join(self.root, "certs"))
        home = Home(self.root, "home", LCHAT_HOME_ORIGINS=origin)
        home.start()
        self.addCleanup(home.stop)
        router.start()
        self.addCleanup(router.stop)
        browser = Chromium(
            self.chromium,
            os.path.join(self.root, "chromium"),
            [
                f"--host-resolver-rules=MAP {HOST} {ADDRESS}",
                f"--explicitly-allowed-ports={port}",  # a random port may be on the unsafe list
                f"--ignore-certificate-errors-spki-list={spki_sha256(leaf)}",
            ],
        )
        self.addCleanup(browser.stop)
        yield self.wait_for("home answering", home.ready, home.log)
        yield self.wait_for("the router answering", router.ready, router.log)
        added = yield deferToThread(
            lchat, "add-service", HOST, "--socket", home.socket, "--env-file", router.env_file
        )
        self.assertEqual(added.returncode, 0, added.stdout + added.stderr)

        page = yield deferToThread(browser.page)
        self.addCleanup(page.close)
        yield deferToThread(page.call, "WebAuthn.enable")
        virtual = yield deferToThread(
            page.call,
            "WebAuthn.addVirtualAuthenticator",
            options={
                "protocol": "ctap2",
                "transport": "internal",
                "hasResidentKey": True,
                "hasUserVerification": True,
                "isUserVerified": True,
                "automaticPresenceSimulation": True,
            },
        )
        authenticator = virtual["authenticatorId"]
        yield deferToThread(page.call, "Page.enable")
        navigated = yield deferToThread(page.call, "Page.navigate", url=f"{origin}/api/version")
        self.assertNotIn(
            "errorText", navigated, f"{navigated}\n{browser.log()}\n{router.log()[-3000:]}"
        )
        yield self.wait_for(
            "the page loaded",
            lambda: (
                page.call("Runtime.evaluate", expression="document.readyState")["result"]["value"]
                == "complete"
            ),
            browser.log,
        )
        blob = os.urandom(1000)
        evaluated = yield deferToThread(
            page.call,
            "Runtime.evaluate",
            expression=FLOW.replace("__VAULT__", base64.b64encode(blob).decode()),
            awaitPromise=True,
            returnByValue=True,
            timeout=60_000,
        )
        if "exceptionDetails" in evaluated:
            details = evaluated["exceptionDetails"]
            self.fail(
                f"the page's flow failed: {details.get('exception', {}).get('description', details)}"
                f"\n--- home ---\n{home.log()[-3000:]}\n--- router ---\n{router.log()[-3000:]}"
            )
        out = json.loads(evaluated["result"]["value"])
        stored = yield deferToThread(
            page.call, "WebAuthn.getCredentials", authenticatorId=authenticator
        )
        metrics = yield deferToThread(admin_get, home.admin, "/metrics")
        self.check(out, origin, blob, stored["credentials"], router.log(), metrics)

    def check(
        self,
        out: dict[str, Any],
        origin: str,
        blob: bytes,
        stored: list[dict[str, Any]],
        router_log: str,
        metrics: str,
    ) -> None:
        # A secure context on the router's HTTPS origin: the pinned certificate was served.
        self.assertEqual((out["origin"], out["secure"]), (origin, True))
        # The passkey the browser made is the one it logged in with, for the one account, and
        # the virtual authenticator holds it as a discoverable credential for HOST.
        created, asserted = out["created"], out["asserted"]
        self.assertEqual(
            (created["type"], created["authenticatorAttachment"]), ("public-key", "platform")
        )
        self.assertEqual(asserted["id"], created["id"])
        uid = out["account"]["uid"]
        self.assertEqual(
            [out["first"]["uid"], out["login"]["uid"], out["second"]["uid"]], [uid, uid, uid]
        )
        self.assertEqual(unb64url(asserted["response"]["userHandle"]), uid.encode())
        self.assertEqual(len(stored), 1, stored)
        self.assertEqual(base64.b64decode(stored[0]["credentialId"]), unb64url(created["rawId"]))
        self.assertTrue(stored[0]["isResidentCredential"])
        self.assertEqual(stored[0]["rpId"], HOST)
        self.assertGreaterEqual(stored[0]["signCount"], 1)  # counted: the login was checked
        # The vault: written once, read back by the first device and by the one that logged in.
        version = out["put"]["body"]["version"]
        self.assertEqual(out["put"]["etag"], f'"{version}"')
        for read in (out["read"], out["reread"]):
            self.assertEqual(read["type"], "application/octet-stream")
            self.assertEqual(read["etag"], f'"{version}"')
            self.assertEqual(base64.b64decode(read["bytes"]), blob)
        # Two devices, the second current; one passkey.
        devices = out["devices"]
        self.assertEqual(
            sorted((d["id"], d["current"]) for d in devices["devices"]),
            sorted([(out["first"]["device"], False), (out["second"]["device"], True)]),
        )
        self.assertEqual([c["id"] for c in devices["credentials"]], [created["id"]])
        # Every call went through the router's HTTPS listener (its access log) to home.
        for request in (
            "POST /api/register/begin",
            "POST /api/register/finish?session=",
            "POST /api/tokens",
            "PUT /api/vault",
            "GET /api/vault",
            "POST /api/login/begin",
            "POST /api/login/finish?session=",
            "GET /api/devices",
        ):
            self.assertIn(f'{HOST} "{request}', router_log)
        for route, count in (
            ("register_finish", 1),
            ("login_finish", 1),
            ("tokens", 2),
            ("vault_put", 1),
            ("vault_get", 2),
        ):
            self.assertIn(
                f'lchat_home_requests_total{{route="{route}",status="200"}} {count}.0', metrics
            )


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def admin_get(path: str, target: str) -> str:
    conn = UnixHTTPConnection(path, timeout=10)
    try:
        conn.request("GET", target)
        return conn.getresponse().read().decode()
    finally:
        conn.close()

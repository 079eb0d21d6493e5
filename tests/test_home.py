"""``twistd lchat-home`` end to end (issue 19): real home processes on a unix socket, a software
authenticator (tests/authenticator.py) in the browser's place, SQLite and moto's S3.

- register a passkey, get a link token, write and read the vault, lose a race (409 with the
  current version), list the kept versions, list and revoke devices and passkeys (a revoked
  token and a revoked passkey are denied);
- two home processes on one S3 bucket: a ceremony begun on one is finished on the other (the
  statelessness proof), and a token minted on one works on the other;
- revocation across replicas: a token both processes checked today costs no store request for
  the authentication, and revoked through one it is refused by the other within its
  ``LCHAT_HOME_REVOCATION_POLL`` (the revocation feed);
- bad input: a tampered or missing session, a replayed registration, an oversize vault, a wrong
  content type, a blind write, an unknown token — each answered clearly, nothing written;
- a store that cannot be used stops the process at boot with a line naming the settings.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat.admin_client import UnixHTTPConnection, Unreachable
from lchat.home.stateless import Ceremonies, load_session_keys
from tests import s3servers
from tests.authenticator import SoftwareAuthenticator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORIGIN = "https://home.example.test"
KEY = base64.b64encode(b"k" * 32).decode()


class Home:
    """One ``twistd -n lchat-home`` process and its directories."""

    def __init__(self, root: str, name: str, **settings: str) -> None:
        self.dir = os.path.join(root, name)
        os.makedirs(os.path.join(self.dir, "data"))
        os.makedirs(os.path.join(self.dir, "run"))
        self.socket = os.path.join(self.dir, "run", "home.sock")
        self.admin = os.path.join(self.dir, "run", "home-admin.sock")
        self.env_file = os.path.join(self.dir, "home.env")
        self.settings = {
            "LCHAT_DATA_DIR": os.path.join(self.dir, "data"),
            "LCHAT_RUN_DIR": os.path.join(self.dir, "run"),
            "LCHAT_HOME_ORIGINS": ORIGIN,
            "LCHAT_HOME_SESSION_KEY": KEY,
            **settings,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in self.settings.items())
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LCHAT_", "AWS_"))}
        env["PYTHONPATH"] = ROOT
        with open(os.path.join(self.dir, "home.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from twisted.scripts.twistd import run; run()",
                    "--nodaemon",
                    "--pidfile=",
                    "lchat-home",
                    "--env-file",
                    self.env_file,
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        with open(os.path.join(self.dir, "home.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the admin socket's /metrics: (name, sorted labels) -> value."""
        conn = UnixHTTPConnection(self.admin, timeout=20)
        try:
            conn.request("GET", "/metrics", headers={"Host": "admin"})
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def ready(self) -> bool:
        try:
            return self.call("GET", "/api/version")[0] == 200
        except (OSError, Unreachable):
            return False

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str = "",
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        conn = UnixHTTPConnection(self.socket, timeout=20)
        hdrs = {"Host": "home.example.test", **(headers or {})}
        data: bytes | None = raw
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        if token:
            hdrs["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            payload = resp.read()
            got = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        if got.get("content-type", "").startswith("application/json"):
            return resp.status, json.loads(payload), got
        return resp.status, payload, got


class HomeTestCase(TestCase):
    timeout = 120

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="home", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.authenticator = SoftwareAuthenticator()

    @inlineCallbacks
    def home(self, name: str = "h", **settings: str) -> Any:
        home = Home(self.root, name, **settings)
        home.start()
        self.addCleanup(home.stop)
        deadline = time.monotonic() + 30
        while not (yield deferToThread(home.ready)):
            assert home.proc is not None
            self.assertIsNone(home.proc.poll(), home.log())
            self.assertLess(time.monotonic(), deadline, home.log())
            yield deferToThread(time.sleep, 0.1)
        return home

    def register(self, begin: Home, finish: Home | None = None) -> dict[str, Any]:
        status, started, _ = begin.call("POST", "/api/register/begin", {})
        assert status == 200, started
        created = self.authenticator.create(started["options"], origin=ORIGIN)
        status, done, _ = (finish or begin).call(
            "POST", f"/api/register/finish?session={started['session']}", {"credential": created}
        )
        assert status == 200, done
        return dict(done)

    def login(self, begin: Home, finish: Home | None = None) -> tuple[int, Any]:
        status, started, _ = begin.call("POST", "/api/login/begin", {})
        assert status == 200, started
        asserted = self.authenticator.get(started["options"], origin=ORIGIN)
        status, done, _ = (finish or begin).call(
            "POST", f"/api/login/finish?session={started['session']}", {"credential": asserted}
        )
        return status, done

    def step_up(self, home: Home, token: str, action: str) -> str:
        """A step-up proof for ``action`` (the passkey asserted for that one change)."""
        status, started, _ = home.call(
            "POST", "/api/step-up/begin", {"action": action}, token=token
        )
        assert status == 200, started
        asserted = self.authenticator.get(started["options"], origin=ORIGIN)
        status, done, _ = home.call(
            "POST",
            f"/api/step-up/finish?session={started['session']}",
            {"credential": asserted},
            token=token,
        )
        assert status == 200, done
        return str(done["step_up"])

    def token(self, home: Home, proof: str) -> dict[str, Any]:
        status, minted, _ = home.call("POST", "/api/tokens", {"proof": proof})
        assert status == 200, minted
        return dict(minted)


class SQLiteHomeTests(HomeTestCase):
    @inlineCallbacks
    def test_passkeys_tokens_devices_and_the_vault(self) -> Any:
        home = yield self.home()
        account = yield deferToThread(self.register, home)
        first = yield deferToThread(self.token, home, account["proof"])
        self.assertEqual(first["uid"], account["uid"])
        token = first["token"]
        # No vault yet.
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault", token=token)
        self.assertEqual((status, body["version"]), (404, "0"))
        # Create it (If-None-Match: *), read it back: the bytes as written, the version as ETag.
        blob = os.urandom(1000)
        put = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}
        status, body, hdrs = yield deferToThread(
            home.call, "PUT", "/api/vault", token=token, headers=put, raw=blob
        )
        self.assertEqual(status, 200, body)
        v1 = body["version"]
        self.assertEqual(hdrs["etag"], f'"{v1}"')
        status, data, hdrs = yield deferToThread(home.call, "GET", "/api/vault", token=token)
        self.assertEqual((status, data, hdrs["etag"]), (200, blob, f'"{v1}"'))
        # Replace it; a second device still holding v1 loses the race with the current version.
        status, body, _ = yield deferToThread(
            home.call,
            "PUT",
            "/api/vault",
            token=token,
            headers={"Content-Type": "application/octet-stream", "If-Match": f'"{v1}"'},
            raw=b"second",
        )
        self.assertEqual(status, 200, body)
        v2 = body["version"]
        status, body, hdrs = yield deferToThread(
            home.call,
            "PUT",
            "/api/vault",
            token=token,
            headers={"Content-Type": "application/octet-stream", "If-Match": f'"{v1}"'},
            raw=b"stale",
        )
        self.assertEqual((status, body["current"], hdrs["etag"]), (409, v2, f'"{v2}"'))
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault/versions", token=token)
        self.assertEqual([v["version"] for v in body["versions"]], [v2, v1])
        status, old, _ = yield deferToThread(
            home.call, "GET", f"/api/vault/versions/{v1}", token=token
        )
        self.assertEqual((status, old), (200, blob))

        # A second device: log in with the passkey, link it, list, revoke it: its token is denied.
        status, logged = yield deferToThread(self.login, home)
        self.assertEqual((status, logged["uid"]), (200, account["uid"]), logged)
        second = yield deferToThread(self.token, home, logged["proof"])
        status, body, _ = yield deferToThread(home.call, "GET", "/api/devices", token=token)
        self.assertEqual(status, 200, body)
        self.assertEqual(len(body["devices"]), 2)
        self.assertEqual(len(body["credentials"]), 1)
        self.assertEqual(
            [d["current"] for d in body["devices"] if d["id"] == first["device"]], [True]
        )
        # Revoking another device takes a step-up (a fresh passkey assertion for that change;
        # tests/test_home_abuse.py has the refusals).
        step_up = yield deferToThread(
            self.step_up, home, token, f"DELETE /api/devices/{second['device']}"
        )
        status, _, _ = yield deferToThread(
            home.call,
            "DELETE",
            f"/api/devices/{second['device']}",
            token=token,
            headers={"Step-Up": step_up},
        )
        self.assertEqual(status, 204)
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault", token=second["token"])
        self.assertEqual(status, 401, body)
        # The last passkey is never deleted (tests/test_home_abuse.py deletes a second one).
        credential = (yield deferToThread(home.call, "GET", "/api/devices", token=token))[1][
            "credentials"
        ][0]["id"]
        action = f"DELETE /api/credentials/{credential}"
        step_up = yield deferToThread(self.step_up, home, token, action)
        status, body, _ = yield deferToThread(
            home.call,
            "DELETE",
            f"/api/credentials/{credential}",
            token=token,
            headers={"Step-Up": step_up},
        )
        self.assertEqual(status, 409, body)
        status, body = yield deferToThread(self.login, home)
        self.assertEqual(status, 200, body)
        # The first device's token still reads the vault.
        status, data, _ = yield deferToThread(home.call, "GET", "/api/vault", token=token)
        self.assertEqual((status, data), (200, b"second"))

    @inlineCallbacks
    def test_bad_input_is_refused_and_writes_nothing(self) -> Any:
        home = yield self.home()
        account = yield deferToThread(self.register, home)
        token = (yield deferToThread(self.token, home, account["proof"]))["token"]
        # A tampered session, a missing one, a replayed registration.
        status, started, _ = yield deferToThread(home.call, "POST", "/api/register/begin", {})
        created = self.authenticator.create(started["options"], origin=ORIGIN)
        session = started["session"]
        tampered = session[:-2] + ("A" if session[-2] != "A" else "B") + session[-1]
        for path, want in (
            (f"/api/register/finish?session={tampered}", 401),
            ("/api/register/finish", 400),
        ):
            status, body, _ = yield deferToThread(home.call, "POST", path, {"credential": created})
            self.assertEqual(status, want, body)
        status, body, _ = yield deferToThread(
            home.call, "POST", f"/api/register/finish?session={session}", {"credential": created}
        )
        self.assertEqual(status, 200, body)
        status, body, _ = yield deferToThread(
            home.call, "POST", f"/api/register/finish?session={session}", {"credential": created}
        )
        self.assertEqual(status, 409, body)
        # A proof is for tokens only and expires; a made-up one is refused.
        status, body, _ = yield deferToThread(
            home.call, "POST", "/api/tokens", {"proof": account["proof"] + "x"}
        )
        self.assertEqual(status, 401, body)
        # A genuine proof (the same LCHAT_HOME_SESSION_KEY) for a uid nobody registered.
        keys, _ = load_session_keys(KEY)
        stranger = Ceremonies.from_keys(keys, time.time).proofs.issue("nobody-here", "link")
        status, body, _ = yield deferToThread(home.call, "POST", "/api/tokens", {"proof": stranger})
        self.assertEqual(status, 401, body)
        # The vault: too big, wrong type, a blind write, a garbage version, an unknown token.
        big = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}
        for headers, raw, want in (
            (big, b"x" * (18 * 1024 + 1), 413),
            ({"Content-Type": "text/plain", "If-None-Match": "*"}, b"x", 415),
            ({"Content-Type": "application/octet-stream"}, b"x", 428),
        ):
            status, body, _ = yield deferToThread(
                home.call, "PUT", "/api/vault", token=token, headers=headers, raw=raw
            )
            self.assertEqual(status, want, body)
        status, body, _ = yield deferToThread(
            home.call,
            "PUT",
            "/api/vault",
            token=token,
            headers={"Content-Type": "application/octet-stream", "If-Match": '"12345"'},
            raw=b"x",
        )
        self.assertIn(status, (400, 409), body)
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault", token=token)
        self.assertEqual(status, 404, body)  # nothing was written
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault", token="nope")
        self.assertEqual(status, 401, body)
        status, body, _ = yield deferToThread(home.call, "GET", "/api/vault")
        self.assertEqual(status, 401, body)
        status, body, _ = yield deferToThread(
            home.call,
            "POST",
            "/api/login/begin",
            raw=b"{not json",
            headers={"Content-Type": "application/json"},
        )
        self.assertEqual(status, 400, body)
        status, body, _ = yield deferToThread(home.call, "GET", "/api/nothing")
        self.assertEqual(status, 404, body)
        # The admin socket: status and metrics.
        conn = UnixHTTPConnection(home.admin, timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
        self.assertIn('lchat_home_requests_total{route="vault_put",status="413"} 1.0', metrics)


def send_body(path: str, head: bytes, chunks: int, chunk: bytes) -> tuple[bytes, int]:
    """Send ``head`` then up to ``chunks`` times ``chunk`` to a unix socket until the server
    stops reading; return everything it answered and how many body bytes went out."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(20)
    sent = 0
    try:
        conn.connect(path)
        conn.sendall(head)
        try:
            for _ in range(chunks):
                conn.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while data := conn.recv(65536):
                answer += data
    finally:
        conn.close()
    return answer, sent


class SQLiteHomeBodyCapTests(HomeTestCase):
    @inlineCallbacks
    def test_a_huge_body_is_refused_before_it_is_buffered(self) -> Any:
        """twisted.web buffers whole bodies: past 64 KiB home answers 413 and stops reading,
        whether the Content-Length says so or the chunks do; then it serves on."""
        home = yield self.home()
        chunk = b"x" * 65536
        head = (
            b"PUT /api/vault HTTP/1.1\r\nHost: home.example.test\r\n"
            b"Content-Type: application/octet-stream\r\nIf-None-Match: *\r\n"
            b"Content-Length: %d\r\n\r\n"
        ) % (1 << 30)
        answer, sent = yield deferToThread(send_body, home.socket, head, 256, chunk)
        self.assertTrue(answer.startswith(b"HTTP/1.1 413 "), answer[:200])
        self.assertIn(b"at most 65536 bytes", answer)
        self.assertLess(sent, 256 * len(chunk))  # it stopped reading: 16 MiB never went in
        chunked = (
            b"POST /api/register/begin HTTP/1.1\r\nHost: home.example.test\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        answer, sent = yield deferToThread(send_body, home.socket, chunked, 256, piece)
        self.assertTrue(answer.startswith(b"HTTP/1.1 413 "), answer[:200])
        self.assertLess(sent, 256 * len(piece))
        # Under the cap, the routes' own limits answer as before; the process serves on.
        status, body, _ = yield deferToThread(
            home.call,
            "POST",
            "/api/register/begin",
            raw=b" " * 60000 + b"{}",
            headers={"Content-Type": "application/json"},
        )
        self.assertEqual(status, 200, body)
        status, body, _ = yield deferToThread(home.call, "GET", "/api/version")
        self.assertEqual(status, 200, body)
        metrics = yield deferToThread(home.metrics)
        refused = metrics[("lchat_home_requests_total", (("route", "oversize"), ("status", "413")))]
        self.assertEqual(refused, 2)


class S3HomeTests(HomeTestCase):
    timeout = 180

    @inlineCallbacks
    def test_a_ceremony_begun_on_one_replica_finishes_on_another(self) -> Any:
        server = yield Deferred.fromCoroutine(s3servers.shared_server("moto"))
        bucket = yield Deferred.fromCoroutine(server.new_bucket())
        # Home keeps its last 5 vault versions with the bucket's versioning (docs/home.md).
        yield deferToThread(
            server.client().put_bucket_versioning,
            Bucket=bucket,
            VersioningConfiguration={"Status": "Enabled"},
        )
        settings = {
            "LCHAT_HOME_STORE": "s3",
            "LCHAT_HOME_S3_BUCKET": bucket,
            "LCHAT_HOME_S3_REGION": server.region,
            "LCHAT_HOME_S3_ENDPOINT": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
        }
        a = yield self.home("a", **settings)
        b = yield self.home("b", **settings)
        account = yield deferToThread(self.register, a, b)  # begun on a, finished on b
        token = (yield deferToThread(self.token, a, account["proof"]))["token"]
        put = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}
        status, body, _ = yield deferToThread(
            b.call, "PUT", "/api/vault", token=token, headers=put, raw=b"on b"
        )
        self.assertEqual(status, 200, body)
        status, data, _ = yield deferToThread(a.call, "GET", "/api/vault", token=token)
        self.assertEqual((status, data), (200, b"on b"))
        status, logged = yield deferToThread(self.login, b, a)
        self.assertEqual((status, logged.get("uid")), (200, account["uid"]), logged)

    @inlineCallbacks
    def moto_settings(self) -> Any:
        server = yield Deferred.fromCoroutine(s3servers.shared_server("moto"))
        bucket = yield Deferred.fromCoroutine(server.new_bucket())
        yield deferToThread(
            server.client().put_bucket_versioning,
            Bucket=bucket,
            VersioningConfiguration={"Status": "Enabled"},
        )
        return {
            "LCHAT_HOME_STORE": "s3",
            "LCHAT_HOME_S3_BUCKET": bucket,
            "LCHAT_HOME_S3_REGION": server.region,
            "LCHAT_HOME_S3_ENDPOINT": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
        }

    @inlineCallbacks
    def test_a_revocation_on_one_replica_is_refused_by_the_other_within_the_poll(self) -> Any:
        """Two home processes on one bucket, a device authenticated on both: reads with its
        token cost no store request for the authentication (the vault's own GET only); revoked
        through one, it is refused by the other within the poll period, which the feed did (the
        other's cache would have trusted it for the rest of the day)."""
        poll = 2.0  # stale after 6 s: a slow LIST on a loaded machine must not flake the count
        settings = yield self.moto_settings()
        settings["LCHAT_HOME_REVOCATION_POLL"] = str(poll)
        a = yield self.home("a", **settings)
        b = yield self.home("b", **settings)
        account = yield deferToThread(self.register, a)
        victim = yield deferToThread(self.token, a, account["proof"])
        status, logged = yield deferToThread(self.login, a)  # a proof mints one token
        self.assertEqual(status, 200, logged)
        keeper = yield deferToThread(self.token, a, logged["proof"])
        put = {"Content-Type": "application/octet-stream", "If-None-Match": "*"}
        status, body, _ = yield deferToThread(
            a.call, "PUT", "/api/vault", token=keeper["token"], headers=put, raw=b"vault"
        )
        self.assertEqual(status, 200, body)

        def read(home: Home, token: str) -> int:
            return home.call("GET", "/api/vault", token=token)[0]

        for home in (a, b):  # the first check of the day on each: pointer + user document
            self.assertEqual((yield deferToThread(read, home, victim["token"])), 200)

        def delta(
            before: dict[Any, float], after: dict[Any, float], name: str, label: str
        ) -> dict[str, float]:
            out: dict[str, float] = {}
            for (sample, labels), value in after.items():
                if sample == name:
                    key = dict(labels)[label]
                    out[key] = out.get(key, 0) + value - before.get((sample, labels), 0)
            return {k: v for k, v in out.items() if v}

        reads = 10
        before = yield deferToThread(b.metrics)
        for _ in range(reads):
            self.assertEqual((yield deferToThread(read, b, victim["token"])), 200)
        after = yield deferToThread(b.metrics)
        operations = delta(before, after, "lchat_home_store_operations_total", "operation")
        self.assertEqual(operations.pop("get_blob", 0), reads, operations)
        self.assertEqual(set(operations) - {"revoked_since"}, set(), operations)  # the polls
        requests = delta(before, after, "lchat_s3_requests_total", "operation")
        self.assertEqual(requests.pop("GetObject", 0), reads, requests)  # blobs/<uid> only
        self.assertEqual(set(requests) - {"ListObjectsV2"}, set(), requests)  # the polls

        applied = after.get(("lchat_home_revocations_applied_total", ()), 0)
        step_up = yield deferToThread(
            self.step_up, a, keeper["token"], f"DELETE /api/devices/{victim['device']}"
        )
        status, body, _ = yield deferToThread(
            a.call,
            "DELETE",
            f"/api/devices/{victim['device']}",
            token=keeper["token"],
            headers={"Step-Up": step_up},
        )
        self.assertEqual(status, 204, body)
        revoked = time.monotonic()
        self.assertEqual((yield deferToThread(read, a, victim["token"])), 401)  # at once on a
        while (yield deferToThread(read, b, victim["token"])) != 401:
            self.assertLess(time.monotonic() - revoked, 30, "b still accepts a revoked token")
            yield deferToThread(time.sleep, poll / 5)
        # Within the poll period, give or take a loaded machine's scheduling.
        self.assertLess(time.monotonic() - revoked, poll + 10)
        now = yield deferToThread(b.metrics)
        self.assertEqual(now.get(("lchat_home_revocations_applied_total", ()), 0), applied + 1)
        self.assertEqual(now.get(("lchat_home_revocation_feed_ok", ()), 0), 1)
        self.assertEqual((yield deferToThread(read, b, keeper["token"])), 200)
        status, body, _ = yield deferToThread(a.call, "GET", "/api/devices", token=keeper["token"])
        self.assertEqual([d["id"] for d in body["devices"]], [keeper["device"]])

    @inlineCallbacks
    def test_an_unusable_bucket_stops_the_process_at_boot(self) -> Any:
        (port,) = s3servers.free_ports(1)
        home = Home(
            self.root,
            "broken",
            LCHAT_HOME_STORE="s3",
            LCHAT_HOME_S3_BUCKET="home-bucket",
            LCHAT_HOME_S3_REGION="us-east-1",
            LCHAT_HOME_S3_ENDPOINT=f"http://127.0.0.1:{port}",
            AWS_ACCESS_KEY_ID="x",
            AWS_SECRET_ACCESS_KEY="y",
        )
        home.start()
        self.addCleanup(home.stop)
        assert home.proc is not None
        code = yield deferToThread(home.proc.wait, 60)
        self.assertEqual(code, 1, home.log())
        self.assertIn("home: cannot start", home.log())
        self.assertIn("LCHAT_HOME_S3_BUCKET", home.log())

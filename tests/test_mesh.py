"""The mesh end to end: three real ``twistd lchat`` processes on 127.0.0.2-4, one moto bucket, a
test CA with a ``*.mesh.test`` wildcard certificate that every box serves.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat import unixhttp
from lchat.cli.dev_cert import make_dev_certs
from lchat.hosts import normalise_member_url
from lchat.mesh import forward, placement
from lchat.registry import Registry, Route
from tests import s3servers
from tests.routerproc import kill_spaces_under, spawn_router

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space"
TOKEN = "mesh-token-" + "x" * 24  # at least 32 characters (config.MIN_MESH_TOKEN)
DOMAIN = "mesh.test"


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def ip_default_cert(certs: str, acme: str, address: str) -> str:
    """A ``default.pem`` in ``acme`` for the IP ``address``, issued by the dev CA in ``certs``:
    what a box serves to a client that sends no SNI, as peers calling its mesh API at
    ``https://<address>:<port>`` do (an IP is never sent as SNI). Returns its path."""
    import datetime as _dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from lchat.cli.dev_cert import CA_CERT, CA_KEY

    with open(os.path.join(certs, CA_CERT), "rb") as f:
        ca_cert = x509.load_pem_x509_certificate(f.read())
    with open(os.path.join(certs, CA_KEY), "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = _dt.datetime.now(_dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(hours=1))
        .not_valid_after(now + _dt.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    path = os.path.join(acme, "default.pem")
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + cert.public_bytes(serialization.Encoding.PEM)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, pem)
    os.close(fd)
    return path


class Box:
    """One router process and its directories."""

    def __init__(self, root: str, name: str, address: str, port: int) -> None:
        self.name = name
        self.address = address
        self.port = port
        self.dir = os.path.join(root, name)
        self.data = os.path.join(self.dir, "data")
        self.run = os.path.join(self.dir, "run")
        self.acme = os.path.join(self.data, "acme")
        self.env_file = os.path.join(self.dir, "router.env")
        self.url = f"https://{address}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        os.makedirs(self.data)
        os.makedirs(self.run)

    @property
    def admin(self) -> str:
        return os.path.join(self.run, "router.sock")

    def registry(self) -> Registry:
        registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        registry.migrate()
        return registry

    def add_space(self, host: str, home_region: str = "") -> None:
        env_file = os.path.join(self.data, f"{host}.env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"LCHAT_ADMIN_TOKEN=" + b"t" * 32 + b"\n")
        os.close(fd)
        self.registry().insert(
            Route(
                host=host,
                kind="instance",
                socket=os.path.join(self.run, f"{host}.sock"),
                status="ready",
                hibernate=True,
                home_region=home_region,
            )
        )

    def write_env(self, settings: dict[str, str]) -> None:
        """``router.env``: this box's own lines, then ``settings``."""
        lines = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run,
            "LCHAT_HTTP_ADDR": "off",
            "LCHAT_HTTPS_ADDR": f"{self.address}:{self.port}",
            "LCHAT_UNITS": "builtin",
            "LCHAT_SPACE_COMMAND": SPACE,
            "LCHAT_MESH_SELF": self.url,
            **settings,
        }
        with open(self.env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in lines.items())

    def start(self, settings: dict[str, str]) -> None:
        self.write_env(settings)
        self.proc = spawn_router(self.env_file, os.path.join(self.dir, "router.log"))

    def log(self) -> str:
        with open(os.path.join(self.dir, "router.log"), errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Stop the router with ``sig``; after SIGKILL its spaces are killed too (as the unit's
        cgroup would), unless ``sig`` is SIGKILL in a test that wants them (see kill_spaces)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill_spaces(self) -> list[int]:
        """Kill whatever spaces this box's router left running (its data or run dir)."""
        return kill_spaces_under(self.dir)

    def admin_call(self, method: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``method path`` on the box's admin socket (a unix socket: no cut reaches it):
        (status, body)."""
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout)
        try:
            sock.connect(self.admin)
            sock.sendall(f"{method} {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        finally:
            sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.admin_call("GET", "/status")[1])
        return result

    def awake(self, host: str) -> bool:
        try:
            return self.status()["hosts"].get(host, {}).get("state") == "awake"
        except (OSError, ValueError):
            return False


def request(
    box: Box,
    host: str,
    path: str = "/api/version",
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    ca: str = "",
) -> tuple[int, bytes, dict[str, str]]:
    """An HTTPS request to ``box``'s address for ``host`` (SNI and Host), verified with the CA."""
    context = ssl.create_default_context(cafile=ca)
    raw = socket.create_connection((box.address, box.port), timeout=20)
    tls = context.wrap_socket(raw, server_hostname=host)
    conn = http.client.HTTPSConnection(host, box.port, timeout=20)
    conn.sock = tls
    hdrs = {"Host": host, **(headers or {})}
    if body:
        hdrs["Content-Type"] = "application/json"
    conn.request(method, path, body=body or None, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}


def ws_roundtrip(box: Box, host: str, ca: str) -> bytes:
    """Open a WebSocket through ``box`` to ``host``'s room, post a message, read its push."""
    context = ssl.create_default_context(cafile=ca)
    raw = socket.create_connection((box.address, box.port), timeout=20)
    tls = context.wrap_socket(raw, server_hostname=host)
    key = base64.b64encode(os.urandom(16)).decode()
    tls.sendall(
        (
            f"GET /api/rooms/ws/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = tls.recv(4096)
        if not chunk:
            raise AssertionError(f"closed during the handshake: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    status, body, _ = request(
        box, host, "/api/rooms/ws/messages", "POST", b'{"body": "over the mesh"}', ca=ca
    )
    assert status == 201, body
    tls.settimeout(10)
    got = head.split(b"\r\n\r\n", 1)[1]
    deadline = time.monotonic() + 10
    while b"over the mesh" not in got and time.monotonic() < deadline:
        got += tls.recv(4096)
    tls.close()
    return got


class MeshTestCase(TestCase):
    """Real routers on one moto bucket: the setup and helpers of the mesh end-to-end tests."""

    timeout = 180

    def setUp(self) -> Deferred[None]:  # type: ignore[override]
        self.root = tempfile.mkdtemp(prefix="mesh", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        certs = os.path.join(self.root, "certs")
        self.ca, _, _ = make_dev_certs(certs, ["*." + DOMAIN])
        self.wildcard = os.path.join(certs, f"wildcard-{DOMAIN}.pem")
        return Deferred.fromCoroutine(self._bucket())

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("moto")
        self.bucket = await self.server.new_bucket()

    def boxes(self, n: int = 3, **settings: str) -> list[Box]:
        ports = s3servers.free_ports(n)
        boxes = [Box(self.root, f"box{i}", f"127.0.0.{i + 2}", ports[i]) for i in range(n)]
        creds = self.server.credentials
        common = {
            "LCHAT_HIBERNATE_BUCKET": self.bucket,
            "LCHAT_HIBERNATE_ENDPOINT": self.server.endpoint,
            "LCHAT_HIBERNATE_REGION": self.server.region,
            "LCHAT_HIBERNATE_IDLE": "60s",
            "LCHAT_LEASE_TTL": "4s",
            "LCHAT_MESH_DOMAINS": DOMAIN,
            "LCHAT_MESH_TOKEN": TOKEN,
            "LCHAT_MESH_HEARTBEAT": "300ms",
            "LCHAT_MESH_DEAD_AFTER": "1500ms",
            "LCHAT_MESH_CA_FILE": self.ca,
            "AWS_ACCESS_KEY_ID": creds.access_key,
            "AWS_SECRET_ACCESS_KEY": creds.secret_key,
            **settings,
        }
        self._aws(creds.access_key, creds.secret_key)
        for box in boxes:
            os.makedirs(box.acme, mode=0o700)
            shutil.copy(self.wildcard, box.acme)
            os.chmod(os.path.join(box.acme, os.path.basename(self.wildcard)), 0o600)
            # Peers reach each other's mesh API at https://<address>:<port> (no SNI).
            ip_default_cert(os.path.dirname(self.wildcard), box.acme, box.address)
            box.settings = common  # type: ignore[attr-defined]
            self.addCleanup(box.kill_spaces)  # (cleanups run last first: after the stop)
            self.addCleanup(box.stop, signal.SIGKILL)
        return boxes

    def _aws(self, key: str, secret: str) -> None:
        # The router's S3 client takes credentials from its environment: give the children ours.
        saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = key, secret

        def restore() -> None:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self.addCleanup(restore)

    @inlineCallbacks
    def start(self, *boxes: Box) -> Any:
        for box in boxes:
            box.start(box.settings)  # type: ignore[attr-defined]
        for box in boxes:
            proc = box.proc
            assert proc is not None
            yield self.wait_for(lambda box=box, proc=proc: _answers(box) or proc.poll() is not None)
            self.assertIsNone(proc.poll(), box.log())
        # Everyone sees everyone before the test starts.
        yield self.wait_for(lambda: all(_members(b) >= len(boxes) for b in boxes), timeout=20)

    @inlineCallbacks
    def wait_for(self, predicate: Any, timeout: float = 30.0, logs: Sequence[Box] = ()) -> Any:
        """``predicate()`` (in a thread) until it is true, for at most ``timeout`` seconds; a
        failure shows the tail of each of ``logs``' router logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = yield deferToThread(predicate)
            if result:
                return result
            yield sleep(0.1)
        tails = "".join(f"\n--- {box.dir}\n{box.log()[-6000:]}" for box in logs)
        self.fail(f"timed out waiting for {predicate}{tails}")

    def req(self, box: Box, host: str, *args: Any, **kw: Any) -> Deferred[Any]:
        kw["ca"] = self.ca
        return deferToThread(lambda: request(box, host, *args, **kw))

    @inlineCallbacks
    def one_space(self, host: str, message: str | None = None, **settings: str) -> Any:
        """Boxes that all know ``host``, started; the space woken (by posting ``message`` through
        the first box, when given). Returns (boxes, the owner it woke on, the others)."""
        boxes = self.boxes(3, **settings)
        for box in boxes:
            box.add_space(host)
        yield self.start(*boxes)
        if message is None:
            status, body, _ = yield self.req(boxes[0], host)
            self.assertEqual(status, 200, body)
        else:
            status, body, _ = yield self.req(
                boxes[0],
                host,
                "/api/rooms/r/messages",
                "POST",
                json.dumps({"body": message}).encode(),
            )
            self.assertEqual(status, 201, body)
        owner = next(b for b in boxes if b.awake(host))
        return boxes, owner, [b for b in boxes if b is not owner]


class MeshTests(MeshTestCase):
    # -- tests ---------------------------------------------------------------------------------

    @inlineCallbacks
    def test_any_box_reaches_the_owner_http_and_websocket(self):
        boxes = self.boxes()

        # Six hosts the rendezvous hash gives two to each box (the boxes' URLs carry random
        # ports: six fixed names could all hash to one box, 1 run in 243).
        def owner(host: str) -> Box:
            return max(boxes, key=lambda b: placement.score(normalise_member_url(b.url), host))

        hosts: list[str] = []
        for host in (f"s{i}.{DOMAIN}" for i in range(200)):
            if sum(1 for h in hosts if owner(h) is owner(host)) < 2:
                hosts.append(host)
        hosts = hosts[:6]
        for box in boxes:
            for host in hosts:
                box.add_space(host)
        yield self.start(*boxes)
        for host in hosts:
            for box in boxes:
                status, body, _ = yield self.req(box, host)
                self.assertEqual(status, 200, (box.name, host, body))
            awake_on = [b.name for b in boxes if b.awake(host)]
            self.assertEqual(len(awake_on), 1, (host, awake_on))
        # The six spaces spread over more than one box (rendezvous hashing).
        owners = {b.name for host in hosts for b in boxes if b.awake(host)}
        self.assertGreater(len(owners), 1)
        # A WebSocket through a box that does not own the space works across the hop.
        host = hosts[0]
        other = next(b for b in boxes if not b.awake(host))
        got = yield deferToThread(ws_roundtrip, other, host, self.ca)
        self.assertIn(b"over the mesh", got)

    @inlineCallbacks
    def test_graceful_stop_of_the_owner_fails_over_with_the_data(self):
        host = f"g.{DOMAIN}"
        _boxes, owner, survivors = yield self.one_space(host, "before")
        code = yield deferToThread(owner.stop, signal.SIGTERM)
        self.assertIn(code, (0, -signal.SIGTERM), owner.log())
        started = time.monotonic()
        status, body, _ = yield self.req(survivors[0], host, "/api/rooms/r/messages")
        failover = time.monotonic() - started
        self.assertEqual(status, 200, body)
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["before"])
        self.assertLess(failover, 10)
        self.assertTrue(any(b.awake(host) for b in survivors))

    @inlineCallbacks
    def test_a_returning_box_never_serves_its_stale_copy(self):
        """A box comes back with a local copy it cannot vouch for (no clean-sleep marker) while
        the space was written elsewhere meanwhile: it restores the newer copy from the bucket."""
        boxes = self.boxes(n=2)
        host = f"back.{DOMAIN}"
        for box in boxes:
            box.add_space(host)
        yield self.start(*boxes)
        yield self.req(boxes[0], host, "/api/rooms/r/messages", "POST", b'{"body": "1"}')
        first = next(b for b in boxes if b.awake(host))
        other = next(b for b in boxes if b is not first)
        yield deferToThread(first.stop, signal.SIGTERM)  # drained: flushed, released, marker
        status, body, _ = yield self.req(
            other, host, "/api/rooms/r/messages", "POST", b'{"body": "2"}'
        )
        self.assertEqual(status, 201, body)
        os.unlink(os.path.join(first.data, f"{host}.db-lchat.json"))  # as after a crash
        first.start(first.settings)  # type: ignore[attr-defined]
        yield self.wait_for(lambda: _members(other) == 2, timeout=20)
        yield deferToThread(other.stop, signal.SIGTERM)
        status, body, _ = yield self.req(first, host, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["1", "2"])
        self.assertTrue(any(".stale-" in n for n in os.listdir(first.data)))

    @inlineCallbacks
    def test_kill_9_of_the_owner_fails_over_after_the_lease_ttl(self):
        host = f"k.{DOMAIN}"
        _boxes, owner, survivors = yield self.one_space(host, "kept")
        yield sleep(1.5)  # the stream class ships within ~1 s
        yield deferToThread(owner.stop, signal.SIGKILL)
        started = time.monotonic()
        result = yield self.wait_for(
            lambda: _ok(request, survivors[0], host, "/api/rooms/r/messages", ca=self.ca),
            timeout=60,
        )
        failover = time.monotonic() - started
        self.assertEqual([m["body"] for m in json.loads(result)["messages"]], ["kept"])
        self.assertLess(failover, 4 + 1.5 + 10)  # lease TTL, membership expiry, a wake

    @inlineCallbacks
    def test_a_forged_marker_is_not_honoured(self):
        host = f"f.{DOMAIN}"
        _boxes, owner, others = yield self.one_space(host)
        other = others[0]
        # (Bound to this very request and box: only the token is wrong.)
        to = forward.Bound(b"GET", b"/api/version", normalise_member_url(other.url))
        forged = forward.marker("wrong-token", host, time.time, to).decode()
        status, _, _ = yield self.req(other, host, headers={"X-Lchat-Mesh-Forwarded": forged})
        self.assertEqual(status, 200)
        # Still served by the owner: the other box forwarded instead of waking it locally.
        self.assertFalse(other.awake(host))
        self.assertTrue(owner.awake(host))

    @inlineCallbacks
    def test_a_frozen_owner_is_taken_over_and_stands_down_when_thawed(self):
        """Freeze the owner (SIGSTOP) past the membership's dead-after, well within its lease's
        TTL: its heartbeat fences the lease (docs/lease.md), so a peer takes the space over at
        once ("holder dead") with every write it had replicated. Thawed, the old owner finds its
        liveness deadline long past: it serves nothing and stands its copy down, so there is
        never a second writer."""
        host = f"v.{DOMAIN}"
        boxes, owner, others = yield self.one_space(host, "one writer", LCHAT_LEASE_TTL="10m")
        yield sleep(2.0)  # the write is replicated (stream: within 1 s)
        assert owner.proc is not None
        owner.proc.send_signal(signal.SIGSTOP)
        try:
            # The others drop it from their view (dead after 1.5 s)...
            yield self.wait_for(lambda: all(_members(b) == 2 for b in others), timeout=20)
            status, body, _ = yield self.req(others[0], host, "/api/rooms/r/messages")
            self.assertEqual(status, 200, body + others[0].log()[-3000:].encode())
            self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["one writer"])
            taker = [b for b in others if b.awake(host)]
            self.assertEqual(len(taker), 1)
            self.assertIn(
                "(holder dead: its box's heartbeat is too old or gone, and it is silent)",
                taker[0].log(),
            )
        finally:
            owner.proc.send_signal(signal.SIGCONT)
        yield self.wait_for(lambda: not owner.awake(host), timeout=20)
        self.assertIn("standing every space down now", owner.log())
        # Until its copy has stopped, the old owner sends the space's requests to the new holder.
        yield self.wait_for(lambda: all(_members(b) == 3 for b in boxes), timeout=20)
        status, body, _ = yield self.req(owner, host, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["one writer"])
        self.assertEqual([b.name for b in boxes if b.awake(host)], [taker[0].name])

    @inlineCallbacks
    def test_create_and_delete_replicate_to_every_box(self):
        """``lchat add-instance --hibernate`` on one box pushes the row (and its env values) to
        the live peers through their mesh API, over TLS verified with the mesh CA; ``remove``
        tombstones it everywhere."""
        boxes = self.boxes(LCHAT_ACCESS_LOG="on")
        for box in boxes:
            self._ip_certificate(box)
        yield self.start(*boxes)
        host = f"new.{DOMAIN}"
        ran = yield deferToThread(
            _lchat, "add-instance", host, "--hibernate", "--env-file", boxes[0].env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertNotIn("failed", ran.stderr.lower(), ran.stderr + boxes[1].log()[-3000:])
        for box in boxes[1:]:
            yield self.wait_for(lambda box=box: host in box.status()["hosts"], timeout=20)
            with open(os.path.join(box.data, f"{host}.env")) as f:
                self.assertIn("LCHAT_ADMIN_TOKEN=", f.read())
        status, body, _ = yield self.req(boxes[2], host, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        yield deferToThread(_lchat, "remove", host, "--env-file", boxes[0].env_file)
        for box in boxes[1:]:
            yield self.wait_for(lambda box=box: host not in box.status()["hosts"], timeout=20)
            self.assertFalse(os.path.exists(os.path.join(box.data, f"{host}.env")))

    def _ip_certificate(self, box: Box) -> None:
        """``default.pem`` for a handshake without SNI (the mesh API at https://127.0.0.N):
        :meth:`boxes` gives every box one already; kept for the tests that make boxes by hand."""
        ip_default_cert(os.path.dirname(self.ca), box.acme, box.address)


def _lchat(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run(
        [sys.executable, "-m", "lchat.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _answers(box: Box) -> bool:
    try:
        box.status()
    except (OSError, ValueError):
        return False
    return True


def _members(box: Box) -> int:
    try:
        return int(box.status().get("mesh", {}).get("live", 0))
    except (OSError, ValueError):
        return 0


def _ok(fn: Any, *args: Any, **kw: Any) -> bytes | None:
    try:
        status, body, _ = fn(*args, **kw)
    except OSError:
        return None
    return body if status == 200 else None


_ = unixhttp  # the admin socket is read with a raw socket here (no reactor in threads)

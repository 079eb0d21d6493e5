"""Issue 29: what a bucket writer and the mesh's own traffic must not be able to do.

A real ``twistd lchat`` router on 127.0.0.2 and one moto bucket; an attacker who can write to the
bucket (and holds no other secret) plants a heartbeat for a listener of its own on 127.0.0.9, kept
fresh. The listener records every request that reaches it. A heartbeat without a MAC made with
the mesh token is no member: the listener must receive no beat, no route push, no forwarded
request, and so never the mesh token.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat.mesh.heartbeat import Heartbeat, HeartbeatKeys
from lchat.mesh.membership import Membership
from lchat.mesh.witness import PeerCallError
from lchat.objstore.file import FileStore
from lchat.reactors import installed
from lchat.threads import thread_runner
from tests.test_mesh import DOMAIN, TOKEN, MeshTestCase, _lchat, ip_default_cert, sleep
from tests.test_mesh_api import Box as ApiBox

reactor = installed()

ATTACKER = "127.0.0.9"


class Listener:
    """An HTTPS server of the attacker's on ``ATTACKER``: a certificate for its IP (what a peer
    call verifies) and, for a client that sends a space's name, the mesh's wildcard (the
    strongest case: a forward would be accepted). Records each request: (method, path,
    headers)."""

    def __init__(self, ip_pem: str, wildcard_pem: str) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.connections = 0
        plain = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        plain.load_cert_chain(ip_pem)
        wild = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        wild.load_cert_chain(wildcard_pem)

        def sni(sock: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
            if name:
                sock.context = wild

        plain.sni_callback = sni
        self.context = plain
        self.sock = socket.create_server((ATTACKER, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.url = f"https://{ATTACKER}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            tls = self.context.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                data += chunk
            head = data.partition(b"\r\n\r\n")[0]
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.requests.append((method, path, headers))
            tls.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
                b"connection: close\r\n\r\n{}"
            )
            tls.close()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def member_key(url: str) -> str:
    return "mesh/members/" + base64.urlsafe_b64encode(url.encode()).rstrip(b"=").decode()


class BucketWriterTests(MeshTestCase):
    timeout = 120

    def plant(self, url: str, body: bytes, stop: threading.Event) -> threading.Thread:
        """Keep ``body`` fresh at ``url``'s member key (a PUT every 200 ms), as a bucket writer
        can, until ``stop``."""
        s3 = self.server.client()

        def loop() -> None:
            while not stop.is_set():
                s3.put_object(Bucket=self.bucket, Key=member_key(url), Body=body)
                stop.wait(0.2)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self.addCleanup(thread.join)
        self.addCleanup(stop.set)
        return thread

    def listener(self) -> Listener:
        certs = os.path.dirname(self.wildcard)
        acme = os.path.join(self.root, "attacker")
        os.makedirs(acme)
        listener = Listener(ip_default_cert(certs, acme, ATTACKER), self.wildcard)
        self.addCleanup(listener.close)
        return listener

    def heartbeat(self, url: str, **fields: Any) -> Heartbeat:
        return Heartbeat(
            url=url, region="", version="0.1.0", started_at=time.time(), epoch="e" * 32,
            process="p" * 32, **fields,
        )  # fmt: skip

    @inlineCallbacks
    def test_a_planted_heartbeat_gets_no_token_push_or_forward(self):
        """The planted member — a body without a MAC, and one with a MAC made under another
        token — gets nothing: no beat, no route push (the spaces' env values), no forwarded
        request; the box sees itself alone and says why."""
        listener = self.listener()
        (box,) = self.boxes(1)
        stop = threading.Event()
        self.plant(listener.url, self.heartbeat(listener.url).to_json(), stop)
        other = self.listener_url_with_wrong_mac(stop)
        yield self.start(box)
        hosts = [f"s{i}.{DOMAIN}" for i in range(6)]
        for host in hosts:
            ran = yield deferToThread(
                _lchat, "add-instance", host, "--hibernate", "--env-file", box.env_file
            )
            self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        for host in hosts:
            status, body, _ = yield self.req(box, host)
            self.assertEqual(status, 200, body)  # served here: the planted box owns no share
        yield sleep(1.5)  # several beats and witness rounds
        self.assertEqual(listener.requests, [], "the planted member was contacted")
        self.assertEqual(listener.connections, 0)
        status = box.status()["mesh"]
        self.assertEqual(status["live"], 1, status)
        log = box.log()
        self.assertIn(f"ignoring the heartbeat of {listener.url}", log)
        self.assertIn(f"ignoring the heartbeat of {other}", log)
        self.assertIn("its MAC does not verify", log)
        self.assertNotIn(TOKEN, log)
        stop.set()

    def listener_url_with_wrong_mac(self, stop: threading.Event) -> str:
        """A second planted member (the same listener's address on another port, never
        listened on), its body MACed under a token that is not the mesh's."""
        url = f"https://{ATTACKER}:1"
        forged = HeartbeatKeys.of("not-the-mesh-token-" + "q" * 20).sign(self.heartbeat(url))
        self.plant(url, forged.to_json(), stop)
        return url

    @inlineCallbacks
    def test_an_authenticated_heartbeat_is_a_member(self):
        """The control: the same listener with a heartbeat MACed under the mesh token is a
        member (it is beaten, with the token): the check above is what keeps the planted one
        out, not something else about it."""
        listener = self.listener()
        (box,) = self.boxes(1)
        stop = threading.Event()
        body = HeartbeatKeys.of(TOKEN).sign(self.heartbeat(listener.url)).to_json()
        self.plant(listener.url, body, stop)
        box.start(box.settings)  # type: ignore[attr-defined]
        yield self.wait_for(lambda: any(r[1] == "/api/mesh/beat" for r in listener.requests))
        beat = next(r for r in listener.requests if r[1] == "/api/mesh/beat")
        self.assertEqual(beat[2]["authorization"], f"Bearer {TOKEN}")
        stop.set()
        _ = json  # (bodies are not read here)


class Recording:
    """A peer channel that records where beats would go (and answers none)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call(self, url: str, body: bytes, timeout: float) -> bytes:  # noqa: ASYNC109
        self.calls.append(url)
        raise PeerCallError(url, "no answer (recorded)")


class ProbeTests(TestCase):
    """A lease in the bucket may name any URL: a takeover's probe of the holder (lchat.mesh.
    fence) goes only to a URL whose heartbeat authenticated, never with the token elsewhere."""

    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="probe", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        box = ApiBox(root, "box-1")
        cfg = box.cfg()
        assert cfg.mesh is not None and cfg.hibernate is not None
        os.makedirs(os.path.join(root, "bucket"))
        store = FileStore(reactor, os.path.join(root, "bucket"), thread_runner(reactor))
        self.channel = Recording()
        self.membership = Membership(reactor, store, cfg.hibernate, cfg.mesh, peers=self.channel)

    @inlineCallbacks
    def test_a_url_no_heartbeat_vouches_for_is_never_probed(self):
        planted = f"https://{ATTACKER}:1"
        answered = yield Deferred.fromCoroutine(self.membership.probe(planted))
        self.assertFalse(answered)  # (as dead as a box that does not answer)
        self.assertEqual(self.channel.calls, [])
        self.assertFalse(self.membership.known(planted))
        # The control: a peer the witness knows (its heartbeat authenticated) is probed.
        self.membership.witnesses.know([planted])
        yield Deferred.fromCoroutine(self.membership.probe(planted))
        self.assertEqual(self.channel.calls, [planted])

"""Creating spaces beyond the row (issue 32, item 7): the readiness probe (``lchat probe``,
``add-instance --probe``) and the setup invite (``lchat invite``, ``add-instance --invite``).

The CLI's own checks run in-process (tests.test_cli's harness); the promises run on two real
routers sharing one bucket (moto, and SeaweedFS in the subclass): a probe wakes the space on its
owner, not on the box it was asked on, and leaves it asleep with a replica in the bucket; a space
that cannot boot fails the probe naming why and stays registered; an invite minted on one box is
claimed through the other, and ``lchat stats`` says setup_complete on both.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from types import MappingProxyType
from typing import Any

from attrs import frozen
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import config, hosts
from lchat.cli import provision
from lchat.cli.mesh import Reach
from lchat.hibernation.space import WakeFailed
from lchat.mesh import placement
from lchat.mesh.placement import in_scope
from lchat.mesh.witness import PeerCallError
from lchat.readiness import MeshProbe, Readiness
from lchat.registry import Registry, Route, RouteTable
from lchat.routesource import RouteSource
from tests import meshnet, s3servers
from tests.fakes import inline
from tests.test_cli import CliTestCase
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _lchat

HOST = "p.example.com"
SELF = "https://box0.example:443"
PEER = "https://box1.example:443"


class _Activator:
    """The activator as the probe sees it (lchat.readiness.ProbeActivator): the wake, the sleep
    and the state of one space, recorded; a wake takes ``wake_takes`` seconds on the clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.states: dict[str, str] = {}
        self.calls: list[str] = []
        self.wake_fails: WakeFailed | None = None
        self.sleep_fails: Exception | None = None
        self.wake_takes = 0.41

    def wake(self, route: Route, reason: str) -> Deferred[None]:
        self.calls.append(f"wake {route.host} {reason}")
        if self.wake_fails is not None:
            return fail(self.wake_fails)
        self.clock.advance(self.wake_takes)
        self.states[route.host] = "awake"
        return succeed(None)

    def sleep(self, host: str, reason: str) -> Deferred[None]:
        self.calls.append(f"sleep {host} {reason}")
        if self.sleep_fails is not None:
            return fail(self.sleep_fails)
        self.states[host] = "asleep"
        return succeed(None)

    def state(self, host: str) -> str:
        return self.states.get(host, "asleep")

    def socket_of(self, host: str) -> str | None:
        return f"/run/{host}.sock" if self.state(host) == "awake" else None


class ReadinessTests(TestCase):
    """:class:`lchat.readiness.Readiness`'s decisions on a fake clock: where it probes, what it
    answers, that it sleeps only what it woke; the peer's answer as the seam gives it."""

    H = f"h.{DOMAIN}"

    def setUp(self) -> None:
        self.data = tempfile.mkdtemp(prefix="probe", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.data, True)
        self.clock = Clock()
        self.activator = _Activator(self.clock)
        self.box = SELF  # what answering_box says
        self.asked: list[str] = []
        self.peer: tuple[int, dict[str, Any]] | Exception = (200, {"host": self.H})
        self.version: tuple[int, bytes] = (200, b'{"version": "9.9", "build": "b-1"}')

    def readiness(self, *rows: Route, mesh: bool = True) -> Readiness:
        registry = Registry(os.path.join(self.data, "registry.db"), clock=time.time)
        table = RouteTable(routes=MappingProxyType({r.host: r for r in rows}))
        routes = RouteSource(reactor, registry, table, run_in_thread=inline)

        async def answering_box(route: Route) -> str:
            return self.box

        async def ask(peer: str, host: str) -> tuple[int, dict[str, Any]]:
            self.asked.append(f"{peer} {host}")
            if isinstance(self.peer, Exception):
                raise self.peer
            return self.peer

        async def read_version(socket: str, host: str) -> tuple[int, bytes]:
            self.asked.append(f"version {socket}")
            return self.version

        seam = MeshProbe(SELF, lambda host: in_scope(host, (DOMAIN,)), answering_box, ask)
        return Readiness(
            routes, self.activator, read_version, self.clock, SELF, seam if mesh else None
        )

    def row(self, host: str = "", **fields: Any) -> Route:
        return Route(
            host or self.H,
            kind="instance",
            socket="/run/x.sock",
            status="ready",
            hibernate=fields.pop("hibernate", True),
            **fields,
        )

    async def test_here_it_wakes_reads_and_sleeps(self) -> None:
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual(code, 200, body)
        self.assertEqual(
            (body["seconds"], body["version"], body["build"], body["box"], body["state"]),
            (0.41, "9.9", "b-1", SELF, "asleep"),
        )
        self.assertEqual(self.activator.calls, [f"wake {self.H} probe", f"sleep {self.H} probe"])
        self.assertEqual(self.asked, [f"version /run/{self.H}.sock"])

    async def test_an_awake_space_is_read_and_left_awake(self) -> None:
        self.activator.states[self.H] = "awake"
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["was_awake"], body["state"]), (200, True, "awake"))
        self.assertNotIn(f"sleep {self.H} probe", self.activator.calls)
        self.assertEqual(self.asked, [f"version /run/{self.H}.sock"], "no peer is asked")

    async def test_a_failed_wake_names_its_reason_and_sleeps_nothing(self) -> None:
        self.activator.wake_fails = WakeFailed(self.H, "spawn", "exec format error")
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"], body["error"]), (503, "spawn", "exec format error"))
        self.assertEqual(self.activator.calls, [f"wake {self.H} probe"])

    async def test_no_version_is_a_failure_and_the_space_sleeps_again(self) -> None:
        self.version = (502, b"")
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"]), (503, "no_version"), body)
        self.assertEqual(self.activator.state(self.H), "asleep")

    async def test_a_failed_sleep_is_an_error_saying_it_stays_awake(self) -> None:
        self.activator.sleep_fails = RuntimeError("flush failed")
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"]), (500, "sleep_failed"), body)
        self.assertIn("flush failed", body["error"])

    async def test_the_owner_probes_when_it_is_a_peer(self) -> None:
        self.box = PEER
        self.peer = (200, {"host": self.H, "seconds": 1.5, "build": "b"})
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["box"], body["seconds"]), (200, PEER, 1.5))
        self.assertEqual(self.asked, [f"{PEER} {self.H}"])
        self.assertEqual(self.activator.calls, [], "nothing woken here")

    async def test_a_peer_without_the_endpoint_or_no_answer(self) -> None:
        self.box = PEER
        self.peer = (404, {"error": "not found"})
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"], body["box"]), (503, "peer_too_old", PEER))
        self.peer = PeerCallError(PEER, "connection refused")
        code, body = await self.readiness(self.row()).answer(self.H)
        self.assertEqual((code, body["reason"]), (503, "owner_unreachable"))
        self.assertIn("connection refused", body["error"])

    async def test_answer_here_never_asks_a_peer(self) -> None:
        self.box = PEER
        code, _ = await self.readiness(self.row()).answer_here(self.H)
        self.assertEqual(code, 200)
        self.assertNotIn(f"{PEER} {self.H}", self.asked)

    async def test_rows_it_does_not_probe(self) -> None:
        probe = self.readiness(self.row(), self.row("svc.example.com", hibernate=False), mesh=False)
        code, body = await probe.answer("nope.example.com")
        self.assertEqual((code, body["reason"]), (404, "unknown_host"))
        code, body = await probe.answer("svc.example.com")
        self.assertEqual((code, body["reason"]), (409, "not_hibernating"))


class ReachTests(SynchronousTestCase):
    def test_the_line_a_mesh_create_prints(self) -> None:
        self.assertEqual(Reach(3, 3, ()).describe(), "registered on 3/3 boxes")
        missed = (("https://b3", "down: converges when it is back"),)
        self.assertEqual(
            Reach(2, 3, missed).describe(),
            "registered on 2/3 boxes (https://b3: down: converges when it is back)",
        )


class InviteCliTests(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.bucket = os.path.join(self.root, "bucket")
        os.mkdir(self.bucket)
        self.write_router_env(LCHAT_HIBERNATE_BUCKET=f"file:{self.bucket}")

    def env(self, host: str = HOST) -> dict[str, str]:
        return config.read_env_file(hosts.env_path(self.data_dir, host))

    def invite_of(self, out: str, host: str = HOST) -> str:
        lines = [ln for ln in out.splitlines() if ln.startswith("setup invite: ")]
        self.assertEqual(len(lines), 1, out)
        prefix = f"setup invite: https://{host}/setup#"
        self.assertTrue(lines[0].startswith(prefix), lines[0])
        return lines[0].removeprefix(prefix)

    def test_add_instance_invite_keeps_only_the_hash(self) -> None:
        result = self.lchat("add-instance", HOST, "--hibernate", "--invite")
        self.assertEqual(result.code, 0, result)
        invite = self.invite_of(result.out)
        self.assertRegex(invite, r"^[A-Za-z0-9_-]{43}$")  # 32 bytes, base64url, unpadded
        env = self.env()
        self.assertEqual(env[provision.INVITE_VAR], hashlib.sha256(invite.encode()).hexdigest())
        self.assertIn("LCHAT_ADMIN_TOKEN", env, "the token's line is kept")
        with open(hosts.env_path(self.data_dir, HOST)) as f:
            self.assertNotIn(invite, f.read(), "the invite itself is written nowhere")

    def test_no_invite_without_the_flag(self) -> None:
        result = self.lchat("add-instance", HOST, "--hibernate")
        self.assertEqual(result.code, 0, result)
        self.assertNotIn("setup invite", result.out)
        self.assertNotIn(provision.INVITE_VAR, self.env())

    def test_invite_mints_once_then_only_rotates(self) -> None:
        self.assertEqual(self.lchat("add-instance", HOST, "--hibernate").code, 0)
        first = self.lchat("invite", HOST)
        self.assertEqual(first.code, 0, first)
        hashed = self.env()[provision.INVITE_VAR]
        again = self.lchat("invite", HOST)
        self.assertFailed(again, "already has a setup invite", "--rotate", "nothing was changed")
        self.assertEqual(self.env()[provision.INVITE_VAR], hashed)
        rotated = self.lchat("invite", HOST, "--rotate")
        self.assertEqual(rotated.code, 0, rotated)
        new = self.invite_of(rotated.out)
        self.assertNotEqual(new, self.invite_of(first.out))
        self.assertEqual(self.env()[provision.INVITE_VAR], hashlib.sha256(new.encode()).hexdigest())
        self.assertIn("takes the new invite at its next wake", rotated.err)

    def test_invite_of_an_unknown_host_or_a_service(self) -> None:
        self.assertFailed(self.lchat("invite", HOST), f"{HOST} is not registered")


class ProbeCliTests(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.bucket = os.path.join(self.root, "bucket")
        os.mkdir(self.bucket)
        self.write_router_env(LCHAT_HIBERNATE_BUCKET=f"file:{self.bucket}")

    def router_answering(self, code: int, body: dict[str, Any] | None) -> list[str]:
        """A router on the admin socket answering POST /probe with ``code`` and ``body`` (None:
        an older router's plain 404); returns the request lines it read."""
        asked: list[str] = []
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.admin_socket)
        listener.listen(8)
        self.addCleanup(listener.close)

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed: the test is over
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                        head += chunk
                    line = head.split(b"\r\n", 1)[0].decode()
                    asked.append(line.rsplit(" ", 1)[0])
                    probing = line.startswith("POST /probe?") and body is not None
                    status, answer = (code, body) if probing else (404, {"error": "not found"})
                    data = json.dumps(answer).encode()
                    conn.sendall(
                        b"HTTP/1.0 %d X\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (status, len(data), data)
                    )

        threading.Thread(target=serve, daemon=True).start()
        return asked

    def test_probe_needs_hibernate_and_registers_nothing(self) -> None:
        result = self.lchat("add-instance", HOST, "--probe")
        self.assertFailed(result, "--probe needs --hibernate", "nothing was registered")
        self.assertIsNone(self.row(HOST))

    def test_a_ready_probe(self) -> None:
        asked = self.router_answering(
            200,
            {"host": HOST, "box": "https://b2", "seconds": 0.41, "version": "9", "build": "b7"},
        )
        result = self.lchat("probe", HOST)
        self.assertEqual(result.code, 0, result)
        self.assertEqual(
            result.out.strip(),
            f"{HOST}: ready in 0.41s on https://b2, build b7 (lchat 9), asleep again",
        )
        self.assertEqual(asked, [f"POST /probe?host={HOST}"])

    def test_a_failed_probe_exits_1_naming_why_and_the_row_stays(self) -> None:
        self.router_answering(
            503,
            {
                "host": HOST,
                "box": "https://b2",
                "reason": "not_ready",
                "error": "it never answered",
            },
        )
        result = self.lchat("add-instance", HOST, "--hibernate", "--probe=30")
        self.assertFailed(
            result, "not ready on https://b2: not_ready: it never answered", "stays registered"
        )
        self.assertIsNotNone(self.row(HOST), "a failed probe removes nothing")

    def test_an_older_router_is_named(self) -> None:
        self.router_answering(404, None)
        result = self.lchat("probe", HOST)
        self.assertFailed(result, "has no POST /probe: it runs an older lchat")

    def test_no_router(self) -> None:
        result = self.lchat("probe", HOST)
        self.assertFailed(result, "no router answers", "only a running router wakes a space")


@frozen
class _Member:
    url: str
    region: str = ""


def _host_owned_by(owner: Box, boxes: list[Box], prefix: str) -> str:
    """A host under the mesh domain whose owner by the hash is ``owner``."""
    members = [_Member(placement.normalise_member_url(b.url)) for b in boxes]
    for n in range(1000):
        host = f"{prefix}{n}.{DOMAIN}"
        best = placement.owner(host, members)
        if best is not None and best.url == placement.normalise_member_url(owner.url):
            return host
    raise AssertionError("no host hashes to that box")


class ProvisionMeshTests(MeshTestCase):
    """The readiness probe on two real routers, one bucket (moto)."""

    @inlineCallbacks
    def test_probe_wakes_on_the_owner_and_sleeps_it(self):
        """Created and probed on box0, the space wakes on box1 (its owner), answers its version,
        and is put back to sleep there: a replica lands in the bucket, nothing stays awake.
        Then a space that cannot boot: exit 1 with the wake's reason, its row still there."""
        boxes = self.boxes(2)
        yield self.start(*boxes)
        host = _host_owned_by(boxes[1], boxes, "probe")
        ran = yield deferToThread(
            _lchat, "add-instance", host, "--hibernate", "--probe", "--env-file", boxes[0].env_file
        )
        log = ran.stdout + ran.stderr + boxes[1].log()[-3000:]
        self.assertEqual(ran.returncode, 0, log)
        self.assertIn("registered on 2/2 boxes", ran.stdout, log)
        owner = placement.normalise_member_url(boxes[1].url)
        self.assertRegex(ran.stdout, rf"{host}: ready in \d+\.\d\ds on {owner}, build ", log)
        self.assertFalse(any(b.awake(host) for b in boxes), "asleep again on every box")
        keys = yield deferToThread(self._keys, f"{host}/")
        self.assertTrue(keys, "the sleep landed a replica in the bucket")
        self.assertIn("probe: " + host + " ready in", boxes[1].log())

        broken = _host_owned_by(boxes[1], boxes, "broken")
        ran = yield deferToThread(
            _lchat, "add-instance", broken, "--hibernate", "--env-file", boxes[0].env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stderr)
        # Its env refuses the start on the owner (as a build that cannot run would): the space
        # exits at once, so the wake fails.
        with open(os.path.join(boxes[1].data, f"{broken}.env"), "a") as f:
            f.write("LCHAT_SETUP_INVITE_SHA256=not-a-hash\n")
        ran = yield deferToThread(_lchat, "probe", broken, "--env-file", boxes[0].env_file)
        self.assertEqual(ran.returncode, 1, ran.stdout + ran.stderr)
        self.assertRegex(
            ran.stderr, rf"lchat: error: {broken} is not ready on {owner}: [a-z_]+: ", ran.stderr
        )
        self.assertIn("row is unchanged", ran.stderr)
        self.assertIsNotNone(boxes[0].registry().get(broken))
        self.assertFalse(any(b.awake(broken) for b in boxes))

    def _keys(self, prefix: str) -> list[str]:
        listed = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for item in listed.get("Contents", [])]


class SeaweedFSProvisionMeshTests(ProvisionMeshTests):
    """The probe on SeaweedFS (its sleep's replica lands in a second S3 implementation)."""

    skip = None if meshnet.weed_available() else "SeaweedFS's weed is not installed"

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()


class InviteMeshTests(MeshTestCase):
    """The setup invite on two real routers (moto): it needs no bucket feature of its own."""

    @inlineCallbacks
    def test_invite_claimed_through_a_non_origin_box(self):
        """Minted on box0 (no space runs for it), claimed once through box1's front door; then
        both boxes' ``lchat stats`` say it is set up."""
        boxes = self.boxes(2)
        yield self.start(*boxes)
        host = f"invite.{DOMAIN}"
        ran = yield deferToThread(
            _lchat, "add-instance", host, "--hibernate", "--invite", "--env-file", boxes[0].env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        line = next(ln for ln in ran.stdout.splitlines() if ln.startswith("setup invite: "))
        invite = line.rsplit("#", 1)[1]
        yield self.wait_for(lambda: host in boxes[1].status()["hosts"], timeout=20)
        wrong = json.dumps({"invite": "x" + invite}).encode()
        status, body, _ = yield self.req(boxes[1], host, "/api/setup", "POST", wrong)
        self.assertEqual((status, json.loads(body)), (403, {"error": "wrong setup invite"}))
        claim = json.dumps({"invite": invite}).encode()
        status, body, _ = yield self.req(boxes[1], host, "/api/setup", "POST", claim)
        self.assertEqual((status, json.loads(body)), (200, {"setup_complete": True}))
        status, body, _ = yield self.req(boxes[0], host, "/api/setup", "POST", claim)
        self.assertEqual(status, 403, body)
        self.assertIn(b"already complete", body)
        for box in boxes:
            got = yield deferToThread(_lchat, "stats", host, "--json", "--env-file", box.env_file)
            self.assertEqual(got.returncode, 0, got.stderr + box.log()[-3000:])
            self.assertIs(json.loads(got.stdout)["setup_complete"], True, got.stdout)

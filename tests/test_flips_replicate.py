"""Hibernate flips replicate (issue 17, item 2): the "lives elsewhere" route shape.

The registry's ``lives_at`` column and its migration; the payload rules; the mesh API refusing
bad shapes (served for real on loopback over a real registry file); the router's forwarding of a
lives-elsewhere row; and, end to end, two real routers on one moto bucket: ``lchat hibernate
--off`` on box A gives box B the lives-elsewhere row within one fan-out, B forwards every request
to A's always-on space (never a wake on B), ``--on`` gives B a hibernating row again, and
``mesh-seed --prune`` repairs a flip that B missed.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import hosts
from lchat.mesh import client, forward, route_payload
from lchat.mesh.routing import MeshRouter
from lchat.registry import MIGRATIONS, SCHEMA_VERSION, Conflict, Registry, RegistryError, Route
from lchat.router import LocalResponse, RemotePeer, RequestHead, Router
from tests import test_mesh
from tests.test_mesh_api import HOST, TOKEN, Box, Served, payload, raw_http, request_bytes

reactor: Any = _reactor
PEER = "https://box-2.example.net"
HERE = "http://box-1.example.net"  # the mesh-API test box's LCHAT_MESH_SELF (tests.test_mesh_api)


def elsewhere(**changes: Any) -> dict[str, Any]:
    """A lives-elsewhere payload, as ``lchat hibernate --off`` on box-2 sends it."""
    body = payload(hibernate=False, env={}, lives_at=PEER)
    body.update(changes)
    return body


# --- the registry ---------------------------------------------------------------------------------


class RegistryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="flip", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.registry = Registry(os.path.join(self.root, "registry.db"), clock=time.time)

    def row(self, **changes: Any) -> Route:
        values: dict[str, Any] = {
            "host": HOST,
            "kind": "instance",
            "socket": f"/run/lchat/{HOST}.sock",
            "db_path": f"/data/{HOST}.db",
            "status": "ready",
            "hibernate": True,
        }
        values.update(changes)
        return Route(**values)

    def test_migration_adds_lives_at_to_existing_rows(self) -> None:
        """A registry at the previous schema keeps its rows; each gets ``lives_at`` ''."""
        path = self.registry.path
        conn = sqlite3.connect(path, isolation_level=None)
        for version in range(SCHEMA_VERSION - 1):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
        conn.execute(
            "INSERT INTO routes (host, kind, socket, status, hibernate) "
            "VALUES (?, 'instance', '/run/x.sock', 'ready', 1)",
            (HOST,),
        )
        conn.close()
        self.assertEqual(self.registry.migrate(), SCHEMA_VERSION - 1)
        route = self.registry.get(HOST)
        assert route is not None
        self.assertEqual(route.lives_at, "")
        self.assertFalse(route.elsewhere)
        self.assertTrue(route.replicated)

    def test_lives_at_only_on_an_always_on_instance_with_a_url(self) -> None:
        self.registry.migrate()
        for bad in (
            self.row(lives_at=PEER),  # hibernating
            self.row(hibernate=False, lives_at="box-2.example.net"),  # no scheme
            self.row(hibernate=False, lives_at="https://box 2"),  # whitespace
            self.row(kind="service", hibernate=False, lives_at=PEER),
        ):
            with self.assertRaises(RegistryError):
                self.registry.insert(bad)
        self.assertEqual(len(self.registry.load()), 0)

    def test_upsert_flips_between_the_two_shapes(self) -> None:
        self.registry.migrate()
        self.registry.upsert_replicated(self.row(next_due=1800000000), next_due=True)
        self.registry.update(HOST, status="failed", last_error="a wake failed")
        moved, created = self.registry.upsert_replicated(
            self.row(hibernate=False, lives_at=PEER, replication="daily")
        )
        self.assertFalse(created)
        self.assertEqual(
            (moved.hibernate, moved.lives_at, moved.next_due, moved.status, moved.replication),
            (False, PEER, 0, "ready", "daily"),
        )
        self.assertEqual(moved.socket, f"/run/lchat/{HOST}.sock")  # local paths are kept
        self.assertEqual(self.registry.get(HOST), moved)
        back, created = self.registry.upsert_replicated(self.row(next_due=1900000000))
        self.assertFalse(created)
        self.assertEqual((back.hibernate, back.lives_at, back.next_due), (True, "", 0))
        # A tombstone removes a lives-elsewhere row like a hibernating one.
        self.registry.upsert_replicated(self.row(hibernate=False, lives_at=PEER))
        deleted = self.registry.delete_replicated(HOST)
        assert deleted is not None
        self.assertTrue(deleted.elsewhere)
        self.assertIsNone(self.registry.get(HOST))

    def test_a_space_running_here_is_never_replaced(self) -> None:
        self.registry.migrate()
        self.registry.insert(self.row(hibernate=False))
        with self.assertRaises(Conflict):
            self.registry.upsert_replicated(self.row(hibernate=False, lives_at=PEER))
        with self.assertRaises(Conflict):
            self.registry.delete_replicated(HOST)
        route = self.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.lives_at), (False, ""))


# --- the payload ----------------------------------------------------------------------------------


class PayloadTests(SynchronousTestCase):
    def test_lives_elsewhere_shape_is_accepted_and_normalised(self) -> None:
        parsed = route_payload.parse_payload(elsewhere(lives_at="HTTPS://Box-2.Example.NET:443/"))
        self.assertEqual(parsed.lives_at, PEER)
        self.assertIsNone(parsed.next_due)
        self.assertEqual(route_payload.parse_payload(payload()).lives_at, "")
        self.assertEqual(route_payload.parse_payload(payload(lives_at="")).lives_at, "")

    def test_bad_shapes(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            (payload(hibernate=False), "hibernate must be"),
            (elsewhere(lives_at=""), "hibernate must be"),
            (elsewhere(lives_at=None), "hibernate must be"),
            (payload(lives_at=PEER), "lives_at must be absent or empty"),
            (elsewhere(lives_at="ftp://box-2.example.net"), "lives_at"),
            (elsewhere(lives_at="https://box-2.example.net/path"), "lives_at"),
            (elsewhere(lives_at="https://u@box-2.example.net"), "lives_at"),
            (elsewhere(lives_at="https://box-2.example.net:99999"), "lives_at"),
            (elsewhere(next_due=0), "never wakes here"),
        ]
        for body, fragment in cases:
            with self.assertRaises(route_payload.PayloadError, msg=repr(body)) as e:
                route_payload.parse_payload(body)
            self.assertIn(fragment, str(e.exception))

    def test_payloads_built_from_rows(self) -> None:
        always_on = Route(HOST, "instance", "/run/x.sock", status="ready", version="2.0")
        shape = client.elsewhere_payload(always_on, "HTTPS://Box-2.example.net:443")
        self.assertEqual(shape["lives_at"], PEER)
        self.assertEqual((shape["hibernate"], shape["env"]), (False, {}))
        self.assertNotIn("next_due", shape)
        self.assertEqual(route_payload.parse_payload(shape).lives_at, PEER)
        # A peer's listing of its lives-elsewhere row round-trips.
        row = Route(HOST, "instance", "/run/x.sock", status="ready", lives_at=PEER)
        self.assertEqual(route_payload.parse_payload(client.route_payload(row, {})).lives_at, PEER)
        for not_always_on in (
            Route(HOST, "instance", "/run/x.sock", hibernate=True),
            row,
            Route(HOST, "service", "/run/x.sock"),
        ):
            with self.assertRaises(ValueError):
                client.elsewhere_payload(not_always_on, PEER)


# --- the mesh API ---------------------------------------------------------------------------------


class APITests(TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="flipapi", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-1")
        # PEER is a member here (its heartbeat authenticated): lives_at may name it.
        self.served = Served(self, self.box, members=lambda url: url == PEER)

    def post(self, body: dict[str, Any]) -> Deferred[tuple[int, dict[str, Any]]]:
        data = request_bytes("POST", client.ROUTE_PATH, json.dumps(body).encode())
        return deferToThread(raw_http, self.served.number, data)

    @inlineCallbacks
    def assertRefused(self, body: dict[str, Any], status: int, fragment: str) -> Any:
        before = (self.box.changes(), self.box.files(), list(self.served.reloads))
        code, answer = yield self.post(body)
        self.assertEqual(code, status, answer)
        self.assertIn(fragment, answer.get("error", ""))
        self.assertEqual((self.box.changes(), self.box.files(), self.served.reloads), before)

    @inlineCallbacks
    def test_flip_off_then_on_over_a_hibernating_row(self) -> Any:
        self.box.add(HOST)  # a replicated hibernating row, with its env file
        code, answer = yield self.post(elsewhere())
        self.assertEqual((code, answer), (200, {"host": HOST, "result": "updated"}))
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.lives_at, route.status), (False, PEER, "ready"))
        self.assertTrue(os.path.exists(self.box.env_path(HOST)))  # left as it was
        code, answer = yield deferToThread(
            raw_http, self.served.number, request_bytes("GET", client.ROUTES_PATH)
        )
        self.assertEqual(code, 200)
        listed = [r for r in answer["routes"] if r["host"] == HOST]
        self.assertEqual(
            [(r["hibernate"], r.get("lives_at"), r["env"]) for r in listed], [(False, PEER, {})]
        )
        code, answer = yield self.post(payload())
        self.assertEqual((code, answer["result"]), (200, "updated"))
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.lives_at), (True, ""))
        self.assertIn(f"mesh route updated: {HOST}", self.served.reloads)

    @inlineCallbacks
    def test_lives_elsewhere_row_is_created_and_tombstoned(self) -> Any:
        code, answer = yield self.post(elsewhere())
        self.assertEqual((code, answer["result"]), (201, "created"))
        self.assertFalse(os.path.exists(self.box.env_path(HOST)))  # never run here: no env
        code, answer = yield deferToThread(
            raw_http, self.served.number, request_bytes("DELETE", f"{client.ROUTE_PATH}/{HOST}")
        )
        self.assertEqual((code, answer), (200, {"host": HOST, "deleted": True}))
        self.assertIsNone(self.box.registry.get(HOST))

    @inlineCallbacks
    def test_refuses_lives_at_this_box(self) -> Any:
        for me in (HERE, "HTTP://Box-1.example.net:80/"):
            yield self.assertRefused(elsewhere(lives_at=me), 400, "is this box")

    @inlineCallbacks
    def test_refuses_over_a_space_running_here_or_a_service(self) -> Any:
        self.box.add(HOST, hibernate=False)
        self.box.add("svc.chat.example.com", kind="service")
        for host in (HOST, "svc.chat.example.com"):
            yield self.assertRefused(elsewhere(host=host), 409, "a peer may not change")
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.lives_at), (False, ""))

    @inlineCallbacks
    def test_refuses_malformed_shapes(self) -> Any:
        yield self.assertRefused(elsewhere(lives_at="box-2.example.net"), 400, "lives_at")
        yield self.assertRefused(elsewhere(lives_at="https://b/x"), 400, "lives_at")
        yield self.assertRefused(payload(hibernate=False), 400, "hibernate must be")
        yield self.assertRefused(payload(lives_at=PEER), 400, "lives_at must be absent")
        yield self.assertRefused(elsewhere(host="a.other.example.org"), 400, "not in this box")


# --- not this box's space ---------------------------------------------------------------------


class NotOursTests(SynchronousTestCase):
    def test_backup_never_chooses_a_lives_elsewhere_rows_database(self) -> None:
        """A file left at the row's database path (from an earlier hibernating life on this
        box) is not this box's data: the backup skips it, as it skips a hibernating row's."""
        from lchat.backup import selection

        db = f"/data/{HOST}.db"
        row = Route(HOST, "instance", "/run/x.sock", status="ready", db_path=db, lives_at=PEER)
        always_on = Route("b.chat.example.com", "instance", "/run/b.sock", db_path="/data/b.db")
        choice = selection.choose(
            [row, always_on],
            registry="/data/registry.db",
            data_dir="/data",
            present={db, "/data/b.db"},
            extra=(),
        )
        chosen, problems = choice.chosen, choice.problems
        self.assertEqual([c.path for c in chosen.values()], ["/data/b.db"])
        self.assertEqual(problems, [])


# --- the router -----------------------------------------------------------------------------------


class _Table:
    def __init__(self, *routes: Route) -> None:
        from lchat.registry import RouteTable

        self.table = RouteTable(routes={r.host: r for r in routes})


class _Membership:
    def live(self) -> list[Any]:
        return []


class _Activator:
    def holds(self, host: str) -> bool:
        raise AssertionError("a lives-elsewhere row never reaches the activator")

    def lease_lost(self, host: str) -> bool:
        raise AssertionError("a lives-elsewhere row never reaches the activator")

    def route(self, route: Route, sidecar: bool = False, write: bool = False) -> Any:
        raise AssertionError("a lives-elsewhere row is never woken")


class RoutingTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="fliprt", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.cfg = Box(root, "box-1").cfg()
        self.mesh = MeshRouter(self.cfg, None, _Membership(), _Activator(), reactor=self.clock)  # type: ignore[arg-type]
        self.row = Route(HOST, "instance", "/run/x.sock", status="ready", lives_at=PEER)

    def router(self, mesh: Any) -> Router:
        return Router(_Table(self.row), activator=_Activator(), mesh=mesh)

    def test_forwarded_to_the_box_that_runs_it(self) -> None:
        router = self.router(self.mesh)
        target = router.route(RequestHead(b"GET", b"/", HOST))
        assert isinstance(target, RemotePeer), target
        self.assertEqual(
            (target.address, target.port, target.tls), ("box-2.example.net", 443, True)
        )
        self.assertEqual(target.server_name, HOST)
        [(name, value)] = target.add_headers
        self.assertEqual(name, forward.HEADER)
        to = forward.Bound(b"GET", b"/", "https://box-2.example.net")
        self.assertTrue(forward.authentic(value, TOKEN, HOST, self.clock.seconds, bound=to))
        # A peer that cannot take it: a 503, never a wake here.
        answer = router.reroute(RequestHead(b"GET", b"/", HOST), target, "unreachable")
        assert isinstance(answer, LocalResponse)
        self.assertEqual((answer.status, answer.label), (503, "elsewhere_unreachable"))

    def test_a_forwarded_request_is_not_forwarded_again(self) -> None:
        here = forward.Bound(b"GET", b"/", HERE)  # sent to this box
        marker = forward.marker(TOKEN, HOST, self.clock.seconds, here)
        target = self.router(self.mesh).route(RequestHead(b"GET", b"/", HOST, forwarded=marker))
        assert isinstance(target, LocalResponse)
        self.assertEqual((target.status, target.label), (503, "elsewhere_loop"))

    def test_without_the_mesh_it_is_unavailable(self) -> None:
        target = self.router(None).route(RequestHead(b"GET", b"/", HOST))
        assert isinstance(target, LocalResponse)
        self.assertEqual((target.status, target.label), (503, "elsewhere"))


# --- end to end: two real routers -----------------------------------------------------------------


class FlipsEndToEndTests(test_mesh.MeshTestCase):
    timeout = 240

    @inlineCallbacks
    def test_flips_reach_the_peer_and_it_forwards_to_the_always_on_box(self) -> Any:
        a, b = self.boxes(2, LCHAT_ACCESS_LOG="on")
        host, other = f"flip.{test_mesh.DOMAIN}", f"other.{test_mesh.DOMAIN}"
        for box in (a, b):
            test_mesh.MeshTests._ip_certificate(self, box)  # type: ignore[arg-type]
            box.add_space(host)
            box.add_space(other)  # keeps --prune's zero-source guard satisfied on box A
        yield self.start(a, b)
        # The router as twistd builds it logs its replication posture once, at start (the
        # seed's "controld posture line"; its content is lchat/mesh/posture.py's, tested there).
        for box in (a, b):
            yield self.wait_for(lambda box=box: f"mesh posture: on as {box.url}" in box.log(), 20)
        # Awake on A, with a message in it.
        woke = yield deferToThread(_wake, a, host)
        self.assertTrue(woke, a.log()[-3000:])
        status, body, _ = yield self.req(
            a, host, "/api/rooms/r/messages", "POST", b'{"body": "kept across the flip"}'
        )
        self.assertEqual(status, 201, body)

        # --off on A: B's row becomes the lives-elsewhere shape within the one fan-out.
        ran = yield deferToThread(
            test_mesh._lchat, "hibernate", host, "--off", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr + a.log()[-3000:])
        self.assertIn(f"pushed to {b.url}: updated", ran.stderr)
        row = b.registry().get(host)
        assert row is not None
        self.assertEqual((row.hibernate, row.lives_at), (False, a.url))
        yield self.wait_for(lambda: _state(b, host) == "elsewhere", timeout=20)
        # A request to B is forwarded to A's always-on space; B never wakes it.
        for _ in range(3):
            status, body, headers = yield self.req(b, host, "/api/rooms/r/messages")
            self.assertEqual(status, 200, body)
            self.assertEqual(
                [m["body"] for m in json.loads(body)["messages"]], ["kept across the flip"]
            )
            self.assertNotIn("x-lchat-wake", headers)
        self.assertNotIn("activator", b.status()["hosts"][host])
        self.assertNotIn("process", b.status()["hosts"][host])  # never run by B's units
        listed = yield deferToThread(test_mesh._lchat, "instances", "--env-file", b.env_file)
        self.assertIn(f"elsewhere {a.url}", listed.stdout, listed.stderr)
        self.assertNotIn(f"activator: {host} awake", b.log())
        self.assertEqual(a.status()["hosts"][host]["hibernate"], False)

        # B missed a flip (its row is a stale hibernating one): --prune on A repairs it.
        b.registry().upsert_replicated(
            Route(
                host,
                "instance",
                os.path.join(b.run, f"{host}.sock"),
                status="ready",
                hibernate=True,
            )
        )
        yield self.wait_for(lambda: b.status()["hosts"][host]["hibernate"], timeout=20)
        ran = yield deferToThread(
            test_mesh._lchat, "mesh-seed", "--prune", b.url, "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn(f"flipped 1 row(s) to live here (always-on on this box): {host}", ran.stdout)
        row = b.registry().get(host)
        assert row is not None
        self.assertEqual((row.hibernate, row.lives_at), (False, a.url))

        # --on on A: B holds a hibernating row again, and reaches the space on A.
        ran = yield deferToThread(
            test_mesh._lchat, "hibernate", host, "--on", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr + a.log()[-3000:])
        self.assertIn(f"pushed to {b.url}: updated", ran.stderr)
        row = b.registry().get(host)
        assert row is not None
        self.assertEqual((row.hibernate, row.lives_at), (True, ""))
        status, body, _ = yield self.req(b, host, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        self.assertEqual(
            [m["body"] for m in json.loads(body)["messages"]], ["kept across the flip"]
        )
        self.assertEqual([box.name for box in (a, b) if box.awake(host)], [a.name])


def _state(box: test_mesh.Box, host: str) -> str | None:
    try:
        state = box.status()["hosts"].get(host, {}).get("state")
    except (OSError, ValueError):
        return None
    return state if isinstance(state, str) else None


def _wake(box: test_mesh.Box, host: str) -> bool:
    """``POST /wake?host=`` on the box's admin socket: woken there, whatever the hash says."""
    import socket

    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    try:
        sock.connect(box.admin)
        sock.sendall(f"POST /wake?host={host} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    return data.startswith(b"HTTP/1.0 200") or data.startswith(b"HTTP/1.1 200")


class CliRefusalTests(SynchronousTestCase):
    def test_hibernate_on_a_lives_elsewhere_row_names_the_box_that_runs_it(self) -> None:
        root = tempfile.mkdtemp(prefix="flipcli", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        box = Box(root, "box-1")
        box.registry.insert(
            Route(HOST, "instance", hosts.socket_path(box.run, HOST), status="ready", lives_at=PEER)
        )
        for flag in ("--on", "--off"):
            ran = test_mesh._lchat("hibernate", HOST, flag, "--env-file", box.env_file)
            self.assertEqual(ran.returncode, 1, ran.stdout + ran.stderr)
            self.assertIn(f"runs always-on on {PEER}", ran.stderr)
        route = box.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.lives_at), (False, PEER))

"""The mesh client (lchat.mesh.client) with its HTTP client injected: ``treq.testing.StubTreq``
over a peer's real route-replication API (lchat.mesh.api), in memory, on a fake clock. The same
calls over real sockets and TLS are in test_mesh_api (ClientTests)."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from lchat.mesh import api, client
from tests.fakes import inline
from tests.handover_fakes import PeerActivator
from tests.test_mesh_api import HOST, TOKEN, Box, payload

PEER = "http://box-1.example.net"


class StubClientTests(SynchronousTestCase):
    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="ms", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        self.box = Box(root, "box-1")
        self.reloads: list[str] = []
        site = api.mesh_site(
            self.box.registry, self.box.cfg(), self.reloads.append, run_in_thread=inline
        )
        self.resource: Resource = site.resource
        self.http: Any = StubTreq(self.resource)
        self.reactor = MemoryReactorClock()  # the calls' clock; StubTreq does the I/O

    def call(self, coroutine: Any) -> Any:
        d = Deferred.fromCoroutine(coroutine)
        self.http.flush()
        return self.successResultOf(d)

    def failure(self, coroutine: Any) -> client.MeshCallError:
        d = Deferred.fromCoroutine(coroutine)
        self.http.flush()
        return self.failureResultOf(d, client.MeshCallError).value

    def kw(self) -> dict[str, Any]:
        return {"reactor": self.reactor, "http": self.http}

    def test_push_list_and_delete_a_route(self) -> None:
        answer = self.call(client.push_route(PEER, TOKEN, payload(), **self.kw()))
        self.assertEqual(answer, {"host": HOST, "result": "created"})
        route = self.box.registry.get(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.replication), (True, "batched"))
        listed = self.call(client.list_routes(PEER, TOKEN, **self.kw()))
        self.assertEqual([r["host"] for r in listed], [HOST])
        self.assertTrue(self.call(client.delete_route(PEER, TOKEN, HOST, **self.kw())))
        self.assertFalse(self.call(client.delete_route(PEER, TOKEN, HOST, **self.kw())))
        self.assertIsNone(self.box.registry.get(HOST))
        self.assertTrue(self.reloads)

    def test_a_refusal_is_a_mesh_call_error_with_its_status(self) -> None:
        error = self.failure(client.push_route(PEER, "wrong-" + TOKEN, payload(), **self.kw()))
        self.assertEqual(error.status, 401)
        self.assertIn(f"{PEER}: answered 401", str(error))
        bad = self.failure(client.push_route(PEER, TOKEN, payload(kind="bogus"), **self.kw()))
        self.assertEqual(bad.status, 400)
        self.assertIsNone(self.box.registry.get(HOST))

    def test_an_answer_never_given_times_out_on_the_callers_clock(self) -> None:
        silent: Any = StubTreq(_Silent())
        d = Deferred.fromCoroutine(
            client.get_json(PEER, TOKEN, "/x", timeout=2.0, reactor=self.reactor, http=silent)
        )
        silent.flush()
        self.assertNoResult(d)
        self.reactor.advance(2.0)
        error = self.failureResultOf(d, client.MeshCallError).value
        self.assertIn("no answer within 2s", str(error))


class StatsCallTests(SynchronousTestCase):
    """``GET /api/mesh/stats/<host>`` (lchat.mesh.api, client.ask_stats): the peer's own answer
    with its status and ``box``, whatever the status; a peer without the endpoint is a 404
    without a ``reason`` (what lchat.spacestats calls ``peer_too_old``)."""

    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="ms", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        self.box = Box(root, "box-1")
        self.asked: list[str] = []
        self.reactor = MemoryReactorClock()

    def peer(self, stats: Any) -> Any:
        site = api.mesh_site(
            self.box.registry, self.box.cfg(), lambda _: None, run_in_thread=inline, stats=stats
        )
        return StubTreq(site.resource)

    def ask(self, http: Any, token: str = TOKEN, host: str = HOST) -> tuple[int, dict[str, Any]]:
        d = Deferred.fromCoroutine(
            client.ask_stats(PEER, token, host, reactor=self.reactor, http=http)
        )
        http.flush()
        result: tuple[int, dict[str, Any]] = self.successResultOf(d)
        return result

    def test_the_peers_answer_and_its_box(self) -> None:
        async def stats(host: str) -> tuple[int, dict[str, Any]]:
            self.asked.append(host)
            if host == HOST:
                return 200, {"host": host, "has_content": True, "source": "database"}
            return 409, {"host": host, "error": "x", "reason": "not_local"}

        http = self.peer(stats)
        box = self.box.cfg().mesh.self_url  # type: ignore[union-attr]
        code, body = self.ask(http)
        self.assertEqual(code, 200)
        self.assertEqual(
            body, {"host": HOST, "has_content": True, "source": "database", "box": box}
        )
        code, body = self.ask(http, host="Other." + HOST)  # (normalised by the caller)
        self.assertEqual((code, body["reason"], body["box"]), (409, "not_local", box))
        self.assertEqual(self.asked, [HOST, "other." + HOST])
        code, body = self.ask(http, token="wrong-" + TOKEN)
        self.assertEqual((code, "reason" in body), (401, False))

    def test_a_peer_without_stats_answers_404_without_a_reason(self) -> None:
        code, body = self.ask(self.peer(None))
        self.assertEqual(code, 404)
        self.assertNotIn("reason", body)


class HoldCallTests(SynchronousTestCase):
    """``POST /api/mesh/hold`` and ``/release`` (lchat.mesh.api, client.hold_space and
    release_space) over the real operator holds (lchat.hibernation.capacity.Holds, in
    tests.handover_fakes.PeerActivator) on a fake clock: what a malformed call gets, and that
    nothing is held then."""

    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="ms", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        self.box = Box(root, "box-1")
        self.box.add(HOST, hibernate=True)
        self.reactor = MemoryReactorClock()
        self.activator = PeerActivator(self.reactor)
        site = api.mesh_site(
            self.box.registry,
            self.box.cfg(),
            lambda _: None,
            run_in_thread=inline,
            holds=self.activator,
        )
        self.http: Any = StubTreq(site.resource)

    def answer(self, call: Any) -> tuple[int, dict[str, Any]]:
        d = Deferred.fromCoroutine(call)
        self.http.flush()
        result: tuple[int, dict[str, Any]] = self.successResultOf(d)
        return result

    def post(self, path: str, body: bytes, token: str = TOKEN) -> int:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        d = self.http.post(PEER + path, data=body, headers=headers)
        self.http.flush()
        code: int = self.successResultOf(d).code
        return code

    def test_held_asleep_until_released(self) -> None:
        self.activator.awake.add(HOST)
        kw = {"reactor": self.reactor, "http": self.http}
        code, body = self.answer(client.hold_space(PEER, TOKEN, HOST.upper(), 90, **kw))
        box = self.box.cfg().mesh.self_url  # type: ignore[union-attr]
        self.assertEqual(
            (code, body), (200, {"host": HOST, "held": 90.0, "state": "asleep", "box": box})
        )
        self.assertEqual(self.activator.calls, [("hold", HOST), ("sleep", HOST)])
        self.assertEqual(self.activator.held.held_asleep(), {HOST: 90.0})
        self.assertEqual(
            self.answer(client.release_space(PEER, TOKEN, HOST, **kw)),
            (200, {"host": HOST, "released": True}),
        )
        self.assertEqual(
            self.answer(client.release_space(PEER, TOKEN, HOST, **kw)),
            (200, {"host": HOST, "released": False}),
        )
        code, body = self.answer(client.hold_space(PEER, TOKEN, "other." + HOST, 90, **kw))
        self.assertEqual((code, body["reason"]), (404, "unknown_host"))

    def test_malformed_or_unauthorised_calls_hold_nothing(self) -> None:
        for body in (
            b'{"host": "a.chat.example.com", "seconds": 0}',
            b'{"host": "a.chat.example.com", "seconds": 3601}',
            b'{"host": "a.chat.example.com", "seconds": true}',
            b'{"host": "a.chat.example.com", "seconds": "60"}',
            b'{"host": "a.chat.example.com"}',
            b'{"host": "a.chat.example.com", "seconds": 60, "why": "x"}',
            b'{"host": "not a host", "seconds": 60}',
            b"[1]",
            b"{",
        ):
            self.assertEqual(self.post("/api/mesh/hold", body), 400, body)
        self.assertEqual(self.post("/api/mesh/release", b'{"host": 1}'), 400)
        ok = b'{"host": "a.chat.example.com", "seconds": 60}'
        self.assertEqual(self.post("/api/mesh/hold", ok, token="wrong-" + TOKEN), 401)
        self.assertEqual(self.activator.calls, [])


class _Silent(Resource):
    isLeaf = True

    def render(self, request: Any) -> Any:
        return NOT_DONE_YET

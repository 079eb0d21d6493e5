"""Due wakes follow the owner (issue 17, item 3): ``next_due`` travels with the route.

The payload's optional ``next_due`` field (old payloads without it still accepted, bad values 400),
the receiving registry's rule (present: it replaces the local value; absent: the local one stays),
and the router's push service (:mod:`lchat.mesh.due`) against a real peer's mesh API on TCP.
"""

from __future__ import annotations

import datetime
import json
import shutil
import signal
import tempfile
import time
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat.mesh import client, route_payload
from lchat.mesh.due import DuePush
from lchat.mesh.members import Member
from lchat.registry import Route
from lchat.routesource import RouteSource
from lchat.threads import thread_runner
from tests import test_mesh
from tests.test_mesh import DOMAIN as MESH_DOMAIN
from tests.test_mesh import MeshTestCase
from tests.test_mesh_api import (
    HOST,
    Box,
    Served,
    payload,
    raw_http,
    request_bytes,
    sample,
)

reactor: Any = _reactor
DUE = 1_900_000_000


def member(url: str, *, me: bool = False, region: str = "ie") -> Member:
    now = datetime.datetime.now(datetime.UTC)
    return Member(
        url=url,
        region=region,
        version="",
        started_at=0.0,
        last_modified=now,
        age=0.0,
        key=url,
        is_self=me,
    )


def pushes(outcome: str) -> float:
    return sample("lchat_mesh_due_pushes_total", outcome=outcome)


class PayloadTests(SynchronousTestCase):
    def test_a_payload_without_next_due_is_accepted_and_keeps_the_local_value(self) -> None:
        parsed = route_payload.parse_payload(payload())
        self.assertIsNone(parsed.next_due)

    def test_next_due_is_read(self) -> None:
        self.assertEqual(route_payload.parse_payload(payload(next_due=DUE)).next_due, DUE)
        self.assertEqual(route_payload.parse_payload(payload(next_due=0)).next_due, 0)
        self.assertEqual(
            route_payload.parse_payload(payload(next_due=2**53 - 1)).next_due, 2**53 - 1
        )

    def test_bad_next_due_values_are_refused(self) -> None:
        for bad in (-1, 2**53, 1.5, float(DUE), "1900000000", True, None, [DUE]):
            with self.assertRaises(route_payload.PayloadError, msg=repr(bad)) as caught:
                route_payload.parse_payload(payload(next_due=bad))
            self.assertIn("next_due", str(caught.exception))

    def test_route_payload_carries_a_due_time_and_a_forced_zero(self) -> None:
        row = Route(host=HOST, kind="instance", socket="/run/x.sock", hibernate=True)
        self.assertNotIn("next_due", client.route_payload(row, {}))  # old peers take it
        due_row = Route(**{**_fields(row), "next_due": DUE})
        self.assertEqual(client.route_payload(due_row, {})["next_due"], DUE)
        self.assertEqual(client.route_payload(row, {}, next_due=0)["next_due"], 0)


def _fields(route: Route) -> dict[str, Any]:
    return {a.name: getattr(route, a.name) for a in Route.__attrs_attrs__}


class ReceivingTests(TestCase):
    """The rule on the receiving box, through its real HTTP API."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="df", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = Box(self.root, "box-2")
        self.served = Served(self, self.box)

    def push(self, body: dict[str, Any]) -> Deferred[dict[str, Any]]:
        return Deferred.fromCoroutine(
            client.push_route(
                self.served.url, self.box.settings["LCHAT_MESH_TOKEN"], body, reactor=reactor
            )
        )

    def due(self) -> int:
        row = self.box.registry.get(HOST)
        assert row is not None
        return row.next_due

    @inlineCallbacks
    def test_present_replaces_absent_keeps(self) -> Any:
        yield self.push(payload(next_due=DUE))
        self.assertEqual(self.due(), DUE)  # created with it
        yield self.push(payload())  # an older peer, or a seed of a row with none
        self.assertEqual(self.due(), DUE)
        yield self.push(payload(next_due=DUE + 60))
        self.assertEqual(self.due(), DUE + 60)
        reloads = len(self.served.reloads)
        answer = yield self.push(payload(next_due=0))  # a due wake elsewhere honoured it
        self.assertEqual(answer["result"], "updated")
        self.assertEqual(self.due(), 0)
        self.assertGreater(len(self.served.reloads), reloads)  # the due sweep re-indexes

    @inlineCallbacks
    def test_a_bad_next_due_is_400_and_writes_nothing(self) -> Any:
        for bad in (-5, 2**53, "soon", 1.5):
            body = json.dumps(payload(next_due=bad)).encode()
            code, answer = yield deferToThread(
                raw_http, self.served.number, request_bytes("POST", "/api/mesh/route", body)
            )
            self.assertEqual(code, 400, answer)
            self.assertIn("next_due", answer["error"])
        self.assertIsNone(self.box.registry.get(HOST))


class _Silent(Protocol):
    """Accepts and never answers."""


class DuePushTests(TestCase):
    """A sleep's due time reaches a real peer's registry; a dead peer is counted, never waited on."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.origin = Box(self.root, "box-1")
        self.peer = Box(self.root, "box-2")
        self.served = Served(self, self.peer)
        self.origin.add(HOST)
        self.routes = RouteSource(
            reactor,
            self.origin.registry,
            self.origin.registry.load(),
            run_in_thread=thread_runner(reactor),
        )
        self.members = [
            member(self.origin.settings["LCHAT_MESH_SELF"], me=True),
            member(self.served.url),
        ]

    def service(self, timeout: float = 5.0) -> DuePush:
        cfg = self.origin.cfg()
        assert cfg.mesh is not None
        due = DuePush(
            reactor,
            cfg.mesh,
            cfg.data_dir,
            self.routes,
            lambda: self.members,
            run_in_thread=thread_runner(reactor),
            timeout=timeout,
        )
        due.startService()
        self.addCleanup(due.stopService)
        return due

    @inlineCallbacks
    def wait_for(self, predicate: Any, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            yield deferLater(reactor, 0.05, lambda: None)
        self.fail(f"timed out waiting for {predicate}")

    def peer_due(self) -> int | None:
        row = self.peer.registry.get(HOST)
        return None if row is None else row.next_due

    @inlineCallbacks
    def test_a_sleeps_due_time_and_its_clear_reach_the_peer(self) -> Any:
        due = self.service()
        pushed = pushes("pushed")
        changed = yield self.routes.record_next_due(HOST, DUE)  # what a sleep records
        self.assertTrue(changed)
        yield due.stopService()  # the drain's wait: every push done
        self.assertEqual(self.peer_due(), DUE)
        self.assertEqual(pushes("pushed"), pushed + 1)
        # A due wake here clears it, and the clear travels too.
        due.startService()
        yield self.routes.record_next_due(HOST, 0, only_if=DUE)
        yield self.wait_for(lambda: self.peer_due() == 0)
        # The env values travelled with the route, so the peer can wake it.
        with open(self.peer.env_path(HOST)) as f:
            self.assertIn(f"LCHAT_ADMIN_TOKEN=tok-{HOST}", f.read())

    @inlineCallbacks
    def test_changes_during_a_push_end_with_the_latest_value(self) -> Any:
        due = self.service()
        for value in (DUE, DUE + 1, DUE + 2, 0, DUE + 3):
            yield self.routes.record_next_due(HOST, value)
        yield due.stopService()
        self.assertEqual(self.peer_due(), DUE + 3)

    @inlineCallbacks
    def test_a_dead_or_silent_peer_is_counted_and_never_blocks(self) -> Any:
        # The silent one first: the refused port, freed next, can then never be handed to it
        # (the kernel reuses a port just freed; two peers on one URL would be one target).
        silent = reactor.listenTCP(0, Factory.forProtocol(_Silent), interface="127.0.0.1")
        self.addCleanup(silent.stopListening)
        refused = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
        refused_url = f"http://127.0.0.1:{refused.getHost().port}"
        yield refused.stopListening()  # nobody listens there any more: connection refused
        self.members += [member(refused_url), member(f"http://127.0.0.1:{silent.getHost().port}")]
        due = self.service(timeout=1.0)
        failed = pushes("failed")
        started = time.monotonic()
        yield self.routes.record_next_due(HOST, DUE)  # the sleep's write returns at once
        self.assertLess(time.monotonic() - started, 0.9)  # not waiting for the silent peer
        yield due.stopService()  # bounded by the calls' timeout
        self.assertLess(time.monotonic() - started, 10)
        self.assertEqual(pushes("failed"), failed + 2)
        self.assertEqual(self.peer_due(), DUE)  # the live peer got it all the same

    @inlineCallbacks
    def test_a_host_outside_the_mesh_is_not_pushed(self) -> Any:
        self.origin.add("solo.elsewhere.org")
        due = self.service()
        pushed = pushes("pushed")
        yield self.routes.record_next_due("solo.elsewhere.org", DUE)
        yield due.stopService()
        self.assertEqual(pushes("pushed"), pushed)
        self.assertIsNone(self.peer.registry.get("solo.elsewhere.org"))


class DueFollowsTheOwnerTests(MeshTestCase):
    """The issue's test: real routers, one moto bucket."""

    @inlineCallbacks
    def test_a_reminder_fires_on_the_new_owner_after_a_drain(self) -> Any:
        host = f"remind.{MESH_DOMAIN}"
        boxes = self.boxes(2, LCHAT_DUE_SWEEP="1s")
        for box in boxes:
            box.add_space(host)
            test_mesh.MeshTests._ip_certificate(self, box)  # type: ignore[arg-type]  # the mesh API's TLS
        yield self.start(*boxes)
        deliver_at = int(time.time()) + 6
        status, body, _ = yield self.req(
            boxes[0],
            host,
            "/api/rooms/r/messages",
            "POST",
            json.dumps({"body": "reminder", "deliver_at": deliver_at}).encode(),
        )
        self.assertEqual(status, 201, body)
        drained = next(b for b in boxes if b.awake(host))  # the owner it woke on
        survivor = next(b for b in boxes if b is not drained)
        # The drain sleeps the space there (its next_due recorded) and leaves the mesh.
        code = yield deferToThread(drained.stop, signal.SIGTERM)
        self.assertIn(code, (0, -signal.SIGTERM), drained.log())
        self.assertFalse(survivor.awake(host))
        # Nobody asks for the space: only the survivor's due sweep can wake it, once due.
        try:
            yield self.wait_for(
                lambda: survivor.awake(host), timeout=max(30, deliver_at - time.time() + 20)
            )
        except self.failureException:
            self.fail(
                f"no due wake on the survivor:\n{drained.log()[-4000:]}\n---\n{survivor.log()[-4000:]}"
            )
        self.assertGreaterEqual(time.time(), deliver_at)
        self.assertIn(f"activator: {host} due wake", survivor.log())
        self.assertIn(
            f"mesh: next due of {host} ({deliver_at}) pushed to {survivor.url}", drained.log()
        )
        status, body, _ = yield self.req(survivor, host, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        self.assertIn("reminder", [m["body"] for m in json.loads(body)["messages"]])

"""The parts of ``lchat relocate`` (issue 17) on each box, one at a time.

- The activator's hold (``Activator.hold``/``release_hold``/``held_asleep``): no wake of a space on
  this box while ``lchat relocate`` copies its replica; on the fake clock and real lifecycle of
  tests/test_activator_machine.py (its harness, imported), so every step is exact.
- The admin API's ``POST /sleep?host=H&hold=S``, ``POST /release?host=H`` and ``held_for`` in
  ``GET /status``: the real ``Site`` over an in-memory transport, on the same harness.
- The mesh's "foreign region" guard (lchat.mesh.routing): a space homed in a region whose replicas
  live in another bucket (``LCHAT_REGION_BUCKETS``) is never woken here from this box's stale copy;
  on the fake-clock MeshRouter harness of tests/test_mesh_routing.py (imported).
- ``LCHAT_MESH_BUCKET`` and the key-pair lookup in lchat.config.
- The router with ``LCHAT_MESH_BUCKET``: an unusable one stops it at boot (a real ``twistd``),
  a usable one (moto) gets the heartbeats, not the hibernation bucket (the router as twistd
  builds it, on the real reactor).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any
from unittest import mock

import attrs
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import config
from lchat.admin import AdminAPI
from lchat.buckets import bucket_key_env
from lchat.config import BoxConfig, ConfigError, mesh_bucket
from lchat.hibernation.capacity import HOLD_RETRY_AFTER
from lchat.mesh import forward, placement, routing
from lchat.mesh.members import member_key, members_prefix
from lchat.objstore.file import FileBucket
from lchat.objstore.where import Where, parse_where
from lchat.registry import Route
from lchat.router import DRAIN_REFUSALS, LocalResponse, LocalSocket, unavailable
from lchat.tap import build_service
from tests.s3servers import shared_server
from tests.test_activator_machine import _Machine, metric
from tests.test_mesh_routing import (
    BOUND,
    SELF,
    SERVED_HERE,
    TOKEN,
    B,
    C,
    Peer,
    View,
    forwards,
    hibernating,
    host_owned_by,
)
from tests.test_mesh_routing import _Base as _RoutingBase

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "moving.example"


def holds(event: str) -> float:
    return metric("lchat_holds_total", event=event)


# -- the activator's hold ------------------------------------------------------------------------


class HoldTests(_Machine):
    def test_a_held_space_fails_its_wake_without_a_bucket_call_or_a_space(self) -> None:
        route = self.add_space(HOST)
        held = holds("held")
        self.activator.hold(HOST, 30.0, "relocate to fi")
        self.assertEqual(holds("held"), held + 1)
        self.assertEqual(self.activator.held_asleep(), {HOST: 30.0})
        calls = self.store.count()
        for reason in ("request", "due", "admin"):  # a request, the due sweep, POST /wake
            why = self.wake_failure(self.activator.wake(route, reason))
            self.assertEqual(
                (why.reason, why.message, why.retry_after), ("held", "relocate to fi", 5.0)
            )
        answer = self.refused(self.activator.route(route), "held")
        self.assertIn(f"{HOST} is being moved".encode(), answer.body)
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"5")
        self.assertEqual(answer.refusal, "")  # not "this box is stopping": a peer must not retry
        self.assertEqual(self.store.count(), calls)  # no lease, no LIST, nothing
        self.assertEqual(self.spawner.of(HOST), [])
        self.assertEqual(self.activator.state(HOST), "asleep")
        self.assertNotIn(HOST, self.claims)
        self.assertEqual(self.activator.status(), {})
        # Another space on the box is not held back by this one's hold.
        self.awake(self.add_space("other.example").host)

    def test_the_hold_beats_a_backoff_and_a_lease_held_elsewhere(self) -> None:
        route = self.add_space(HOST)
        self.spawner.refuse = "cannot exec"
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).reason, "spawn")
        self.activator.hold(HOST, 30.0, "relocate")
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).reason, "held")
        self.spawner.refuse = None
        other = self.add_space("leased.example")
        self.hold_elsewhere("leased.example")
        first = self.run_until(self.activator.wake(other, "request"))
        self.assertEqual(self.wake_failure(first).reason, "lease_held")
        self.activator.hold("leased.example", 30.0, "relocate")
        calls = self.store.count()
        # Within the quarter second the lease answer is kept in memory, and past it.
        self.assertEqual(self.wake_failure(self.activator.wake(other, "request")).reason, "held")
        self.advance(0.5)
        self.assertEqual(self.wake_failure(self.activator.wake(other, "request")).reason, "held")
        self.assertEqual(self.store.count(), calls)

    def test_retry_after_is_the_time_the_hold_has_left_when_that_is_shorter(self) -> None:
        route = self.add_space(HOST)
        self.activator.hold(HOST, 30.0, "relocate")
        self.advance(27.5)
        why = self.wake_failure(self.activator.wake(route, "request"))
        self.assertEqual((why.reason, why.retry_after), ("held", 2.5))
        self.assertLessEqual(why.retry_after, HOLD_RETRY_AFTER)
        self.assertEqual(self.activator.held_asleep(), {HOST: 2.5})
        answer = self.refused(self.activator.route(route), "held")
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"3")  # rounded up

    def test_the_hold_ends_at_its_deadline_on_the_clock_and_counts_expired(self) -> None:
        route = self.add_space(HOST)
        self.activator.hold(HOST, 10.0, "relocate")
        expired = holds("expired")
        self.advance(9.5)
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).reason, "held")
        self.assertEqual(self.activator.held_asleep(), {HOST: 0.5})
        self.assertEqual(holds("expired"), expired)
        self.advance(0.5)
        self.assertEqual(self.activator.held_asleep(), {})  # shown no more at its deadline
        self.awake(HOST)  # the next request wakes it
        self.assertEqual(holds("expired"), expired + 1)
        self.assertEqual(len(self.spawner.of(HOST)), 1)
        self.assertFalse(self.activator.release_hold(HOST))  # the expired hold is gone

    def test_release_says_whether_there_was_a_hold_and_the_next_request_wakes_it(self) -> None:
        route = self.add_space(HOST)
        released = holds("released")
        self.assertFalse(self.activator.release_hold(HOST))
        self.assertEqual(holds("released"), released)
        self.activator.hold(HOST, 600.0, "relocate")
        self.refused(self.activator.route(route), "held")
        self.assertTrue(self.activator.release_hold(HOST))
        self.assertEqual(holds("released"), released + 1)
        self.assertEqual(self.activator.held_asleep(), {})
        self.assertFalse(self.activator.release_hold(HOST))
        self.assertEqual(holds("released"), released + 1)
        self.assertIsInstance(self.target(self.activator.route(route)), LocalSocket)

    def test_a_hold_past_its_deadline_is_not_released_it_expired(self) -> None:
        """``lchat relocate`` lifts its hold after the flip; when the copy outlasted the hold,
        the answer and the metric must say the hold had expired (as ``held_asleep`` and
        ``GET /status`` already do), not that a hold was released."""
        self.add_space(HOST)
        self.activator.hold(HOST, 10.0, "relocate")
        expired, released = holds("expired"), holds("released")
        self.advance(20.0)  # no request meanwhile
        self.assertEqual(self.activator.held_asleep(), {})
        self.assertFalse(self.activator.release_hold(HOST))
        self.assertEqual((holds("expired"), holds("released")), (expired + 1, released))
        self.assertFalse(self.activator.release_hold(HOST))
        self.assertEqual(holds("expired"), expired + 1)  # counted once

    def test_the_seconds_are_clamped_to_an_hour_and_to_none(self) -> None:
        route = self.add_space(HOST)
        self.activator.hold(HOST, 1e9, "a typo")
        self.assertEqual(self.activator.held_asleep(), {HOST: 3600.0})
        self.advance(3599.75)
        self.assertEqual(self.wake_failure(self.activator.wake(route, "request")).reason, "held")
        self.advance(0.25)
        self.awake(HOST)
        other = self.add_space("other.example")
        self.activator.hold("other.example", -5.0, "negative")
        self.assertEqual(self.activator.held_asleep(), {})
        self.assertIsNone(self.successResultOf(self.activator.wake(other, "request")))

    def test_a_hold_leaves_an_awake_space_serving(self) -> None:
        route = self.add_space(HOST)
        self.awake(HOST)
        self.activator.hold(HOST, 30.0, "relocate")
        self.assertIsInstance(self.activator.route(route), LocalSocket)
        self.assertIsNone(self.successResultOf(self.activator.wake(route, "admin")))
        self.assertEqual(self.activator.held_asleep(), {HOST: 30.0})  # for when it sleeps

    def test_requests_queued_while_it_stops_are_refused_rather_than_waking_it_again(
        self,
    ) -> None:
        """The hold placed before the sleep (POST /sleep?hold=): tests/test_activator_machine.py
        WakeAgainTests shows the same queue waking it again without one."""
        route = self.add_space(HOST)
        self.awake(HOST).stop_delay = 3.0
        self.activator.hold(HOST, 60.0, "relocate")
        slept = self.activator.sleep(HOST, "admin")
        self.assertEqual(self.activator.state(HOST), "stopping")
        queued = [self.activator.route(route) for _ in range(3)]
        self.advance(3.0)
        self.successResultOf(slept)
        for d in queued:
            self.refused(d, "held")
        self.assertEqual(len(self.spawner.of(HOST)), 1)  # never woken again
        self.assertEqual(self.activator.state(HOST), "asleep")
        self.assertIsNone(self.lock_owner(HOST))  # released: relocate may copy now

    def test_a_hold_placed_while_it_stops_refuses_what_queued_before_it(self) -> None:
        route = self.add_space(HOST)
        self.awake(HOST).stop_delay = 3.0
        slept = self.activator.sleep(HOST, "idle")
        queued = self.activator.route(route)  # would wake it again once stopped...
        self.advance(1.0)
        self.activator.hold(HOST, 60.0, "relocate")  # ...but the hold comes first
        self.advance(2.0)
        self.successResultOf(slept)
        self.refused(queued, "held")
        self.assertEqual(len(self.spawner.of(HOST)), 1)
        self.assertEqual(self.activator.state(HOST), "asleep")


class HeldAnswerTests(SynchronousTestCase):
    def test_the_public_answer_says_it_is_being_moved_and_when_to_come_back(self) -> None:
        answer = unavailable(HOST, "held", 2.5)
        self.assertEqual((answer.status, answer.label), (503, "wake_held"))
        self.assertEqual(
            answer.body,
            f"503 Service Unavailable: {HOST} is being moved; try again in 3s\n".encode(),
        )
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"3")
        # Not a drain refusal: a peer that forwarded it must not send it elsewhere to be woken.
        self.assertNotIn("held", DRAIN_REFUSALS)
        self.assertEqual(unavailable(HOST, "held", 5.0, stopping=True).refusal, "")


# -- the admin API ---------------------------------------------------------------------------------


class AdminHoldTests(_Machine):
    def setUp(self) -> None:
        super().setUp()
        self.admin = AdminAPI(self.clock, self.routes, "builtin", activator=self.activator)

    def send(self, method: str, path: str, admin: AdminAPI | None = None) -> StringTransport:
        """Send one request to the admin API's real Site (HTTP/1.0: the answer ends the
        connection); what it answers lands in the transport returned."""
        site = (admin or self.admin).site()
        site.reactor = self.clock  # the channel's timeouts: never on the global reactor
        channel = site.buildProtocol(None)
        assert channel is not None
        transport = StringTransport()
        channel.makeConnection(transport)
        self.addCleanup(channel.connectionLost, Failure(ConnectionDone()))
        channel.dataReceived(f"{method} {path} HTTP/1.0\r\nHost: admin\r\n\r\n".encode())
        return transport

    def call(self, method: str, path: str, admin: AdminAPI | None = None) -> tuple[int, Any]:
        """:meth:`send`, the clock moving until it is answered: ``(status, JSON body)``."""
        transport = self.send(method, path, admin)
        for _ in range(1000):
            head, found, body = transport.value().partition(b"\r\n\r\n")
            if found and transport.disconnecting:
                return int(head.split(b" ", 2)[1]), json.loads(body)
            self.advance(0.25)
        self.fail(f"{method} {path} was never answered")

    def test_sleep_with_a_hold_sleeps_it_and_keeps_it_asleep_until_released(self) -> None:
        route = self.add_space(HOST)
        self.awake(HOST)
        code, body = self.call("POST", f"/sleep?host={HOST}&hold=30")
        self.assertEqual(code, 200, body)
        self.assertEqual((body["host"], body["state"]), (HOST, "asleep"))
        self.assertIsNone(self.lock_owner(HOST))
        code, status = self.call("GET", "/status")
        self.assertEqual(status["hosts"][HOST]["held_for"], 30.0)
        self.assertEqual(self.wake_failure(self.activator.wake(route, "due")).reason, "held")
        code, body = self.call("POST", f"/wake?host={HOST}")  # the warm request: refused too
        self.assertEqual(code, 503, body)
        self.assertEqual(self.spawner.of(HOST)[1:], [])
        self.assertEqual(
            self.call("POST", f"/release?host={HOST}"), (200, {"host": HOST, "released": True})
        )
        self.assertNotIn("held_for", self.call("GET", "/status")[1]["hosts"][HOST])
        self.assertEqual(
            self.call("POST", f"/release?host={HOST}"), (200, {"host": HOST, "released": False})
        )
        self.assertIsNone(self.successResultOf(self.activator.wake(route, "request")))

    def test_the_hold_begins_before_the_sleep(self) -> None:
        """A request that queued while the space stopped must not wake it again before relocate
        copies it (a hold placed after the sleep answered would be too late)."""
        route = self.add_space(HOST)
        self.awake(HOST).stop_delay = 3.0
        transport = self.send("POST", f"/sleep?host={HOST}&hold=60")
        self.assertEqual(self.activator.state(HOST), "stopping")
        queued = self.activator.route(route)
        self.advance(3.0)
        self.assertTrue(transport.value().startswith(b"HTTP/1.0 200"), transport.value())
        self.refused(queued, "held")
        self.assertEqual(len(self.spawner.of(HOST)), 1)
        self.assertEqual(self.activator.state(HOST), "asleep")

    def test_a_bad_hold_is_a_400_and_neither_holds_nor_sleeps(self) -> None:
        self.add_space(HOST)
        self.awake(HOST)
        for bad in ("0", "-1", "abc", "3601", "", "nan", "inf", "%ff"):
            code, body = self.call("POST", f"/sleep?host={HOST}&hold={bad}")
            self.assertEqual(code, 400, (bad, body))
            self.assertIn("hold", body["error"])
            self.assertEqual(self.activator.held_asleep(), {}, bad)
            self.assertEqual(self.activator.state(HOST), "awake", bad)
        self.assertEqual(len(self.spawner.of(HOST)), 1)
        # The limits themselves are accepted.
        self.assertEqual(self.call("POST", f"/sleep?host={HOST}&hold=3600")[0], 200)
        self.assertEqual(self.activator.held_asleep(), {HOST: 3600.0})
        self.assertEqual(self.call("POST", f"/sleep?host={HOST}&hold=0.5")[0], 200)
        self.assertEqual(self.activator.held_asleep(), {HOST: 0.5})

    def test_hold_and_release_only_for_a_hibernating_instance(self) -> None:
        self.add_space("always.example", hibernate=False)
        self.registry.insert(Route("svc.example", kind="service", socket="/srv/x.sock"))
        self.successResultOf(self.routes.reload("test"))
        for host in ("always.example", "svc.example", "nobody.example"):
            code, body = self.call("POST", f"/sleep?host={host}&hold=30")
            self.assertEqual(code, 404, body)
            self.assertIn("is not a hibernating instance", body["error"])
            self.assertEqual(self.call("POST", f"/release?host={host}")[0], 404)
        self.assertEqual(self.activator.held_asleep(), {})
        self.assertEqual(self.call("POST", "/release?host=bad..host")[0], 400)
        self.assertEqual(self.call("POST", "/release")[0], 400)  # no host at all

    def test_release_is_a_post_and_needs_hibernation(self) -> None:
        self.add_space(HOST)
        self.activator.hold(HOST, 30.0, "relocate")
        code, body = self.call("GET", f"/release?host={HOST}")
        self.assertEqual((code, body), (405, {"error": "method not allowed"}))
        self.assertEqual(self.activator.held_asleep(), {HOST: 30.0})  # a GET changes nothing
        off = AdminAPI(self.clock, self.routes, "builtin")
        code, body = self.call("POST", f"/release?host={HOST}", admin=off)
        self.assertEqual(code, 409, body)
        self.assertIn("LCHAT_HIBERNATE_BUCKET", body["error"])

    def test_status_shows_held_for_while_held_and_only_then(self) -> None:
        self.add_space(HOST)
        self.add_space("free.example")
        self.activator.hold(HOST, 20.0, "relocate")
        self.advance(5.0)
        hosts = self.call("GET", "/status")[1]["hosts"]
        self.assertEqual(hosts[HOST]["held_for"], 15.0)
        self.assertEqual(hosts[HOST]["state"], "asleep")
        self.assertNotIn("held_for", hosts["free.example"])
        self.advance(15.0)
        self.assertNotIn("held_for", self.call("GET", "/status")[1]["hosts"][HOST])


# -- the mesh: a space homed in a region whose replicas live elsewhere -----------------------------


FI_BUCKET = Where("bucket-fi", "prod", "eu-north-1")


class ForeignRegionTests(_RoutingBase):
    """This box (region ie, the harness's ``file:`` bucket with prefix ``prod``) with
    LCHAT_REGION_BUCKETS naming ``fi`` in another bucket, ``lv`` in the same bucket under another
    prefix, and ``ie`` (its own region) and ``se`` in its own bucket."""

    def setUp(self) -> None:
        super().setUp()
        hib = self.hib
        ours = Where(hib.bucket, hib.prefix)
        assert self.cfg.mesh is not None
        self.cfg = attrs.evolve(
            self.cfg,
            mesh=attrs.evolve(self.cfg.mesh, region="ie"),
            region_buckets={
                "fi": FI_BUCKET,
                "ie": ours,
                "lv": attrs.evolve(ours, prefix="other"),
                "se": ours,
            },
        )
        self.lines: list[dict[str, Any]] = []
        observer: Any = self.lines.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def warned(self, host: str) -> int:
        return sum(
            1
            for e in self.lines
            if e.get("log_namespace") == "lchat.mesh"
            and e.get("host") == host
            and "has no live box" in str(e.get("log_format", ""))
        )

    def assertRegionDown(self, target: Any, host: str) -> None:
        assert isinstance(target, LocalResponse), target
        self.assertEqual((target.status, target.label), (503, "region_down"))
        self.assertEqual(
            dict(target.headers)[b"retry-after"], str(routing.RETRY_AFTER_SECONDS).encode()
        )
        self.assertIn(f"{host} is temporarily unavailable".encode(), target.body)
        self.assertNotIn(b"fi", target.body.replace(host.encode(), b""))  # no topology to clients

    def test_owned_here_by_fallback_it_is_a_503_never_a_wake(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(B, "ie")))  # no live fi box
        host = host_owned_by(SELF, SELF, B)
        self.assertEqual(
            mesh.owner_url(hibernating(host, "fi")), placement.normalise_member_url(SELF)
        )
        down = forwards("region_down")
        self.assertRegionDown(self.routed(mesh, host, home_region="fi"), host)
        self.assertEqual(self.served, [])  # local() never called
        self.assertEqual(forwards("region_down"), down + 1)
        # The due sweep never wakes it here either; the same host homed anywhere else would.
        self.assertFalse(mesh.is_owner(hibernating(host, "fi")))
        self.assertTrue(mesh.is_owner(hibernating(host, "ie")))
        self.assertTrue(mesh.is_owner(hibernating(host)))

    def test_a_forwarded_request_for_it_is_refused_too(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(B, "ie")))
        # Ours by the fallback, or B's by the hash (a peer that thought otherwise): a 503 here.
        host, theirs = host_owned_by(SELF, SELF, B), host_owned_by(B, SELF, B)
        for h in (host, theirs):
            marker = forward.marker(TOKEN, h, self.clock.seconds, BOUND)
            self.assertRegionDown(self.routed(mesh, h, forwarded=marker, home_region="fi"), h)
        self.assertEqual(self.served, [])
        # The same forward for a space homed in our bucket's regions is served here.
        for region in ("ie", "se", ""):
            marker = forward.marker(TOKEN, theirs, self.clock.seconds, BOUND)
            self.assertIs(
                self.routed(mesh, theirs, forwarded=marker, home_region=region), SERVED_HERE
            )
        self.assertEqual(self.served, [theirs] * 3)

    def test_owned_by_a_peer_it_is_forwarded_as_before(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(B, "ie")))
        theirs = host_owned_by(B, SELF, B)
        self.assertForwardedTo(self.routed(mesh, theirs, home_region="fi"), B, theirs)
        # With a live fi box, every fi space goes there (it holds the replica).
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(C, "fi")))
        mine = host_owned_by(SELF, SELF, C)
        self.assertForwardedTo(self.routed(mesh, mine, home_region="fi"), C, mine)
        self.assertFalse(mesh.is_owner(hibernating(mine, "fi")))
        self.assertEqual(self.served, [])

    def test_regions_in_our_bucket_and_unlisted_regions_are_served_here(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie")))
        host = host_owned_by(SELF, SELF, B)
        for region in ("ie", "se", "jp", ""):  # own, same bucket, not in LCHAT_REGION_BUCKETS
            self.assertIs(self.routed(mesh, host, home_region=region), SERVED_HERE, region)
            self.assertTrue(mesh.is_owner(hibernating(host, region)), region)
        # Same bucket, another prefix: another place, so foreign.
        self.assertRegionDown(self.routed(mesh, host, home_region="lv"), host)
        self.assertFalse(mesh.is_owner(hibernating(host, "lv")))
        self.assertEqual(self.served, [host] * 4)

    def test_without_region_buckets_nothing_is_foreign(self) -> None:
        self.cfg = attrs.evolve(self.cfg, region_buckets={})
        mesh = self.mesh(View(Peer(SELF, "ie")))
        host = host_owned_by(SELF, SELF, B)
        self.assertIs(self.routed(mesh, host, home_region="fi"), SERVED_HERE)
        self.assertTrue(mesh.is_owner(hibernating(host, "fi")))

    def test_a_space_already_awake_here_keeps_being_served_here(self) -> None:
        """Awake here (woken before the guard could apply, or by this box before it moved): its
        lease is ours, so requests go on to it rather than getting a 503."""
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(B, "ie")))
        host = host_owned_by(SELF, SELF, B)
        self.running.hosts.add(host)
        self.assertIs(self.routed(mesh, host, home_region="fi"), SERVED_HERE)
        marker = forward.marker(TOKEN, host, self.clock.seconds, BOUND)
        self.assertIs(self.routed(mesh, host, forwarded=marker, home_region="fi"), SERVED_HERE)
        self.assertEqual(self.served, [host, host])
        self.running.hosts.clear()  # asleep again: the guard applies again
        self.assertRegionDown(self.routed(mesh, host, home_region="fi"), host)

    def test_a_space_woken_here_while_its_lease_was_read_is_served_here(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie"), Peer(B, "ie")))
        host = host_owned_by(SELF, SELF, B)
        self.disk.hold()  # the read of its lease is under way...
        d = self.route(mesh, host, home_region="fi")
        self.assertFalse(d.called)
        self.running.hosts.add(host)  # ...when another request's wake here begins
        self.disk.release()
        self.assertIs(self.successResultOf(d), SERVED_HERE)
        self.assertEqual(self.served, [host])

    def test_the_warning_is_one_line_per_host_per_interval(self) -> None:
        mesh = self.mesh(View(Peer(SELF, "ie")))
        one, two = host_owned_by(SELF, SELF, B), host_owned_by(SELF, SELF, C)
        for _ in range(5):
            self.assertRegionDown(self.routed(mesh, one, home_region="fi"), one)
        self.assertEqual(self.warned(one), 1)
        [line] = [
            e
            for e in self.lines
            if e.get("host") == one and "has no live box" in str(e.get("log_format", ""))
        ]
        self.assertEqual(line["region"], "fi")
        self.routed(mesh, two, home_region="fi")
        self.assertEqual(self.warned(two), 1)  # its own line
        self.clock.advance(routing.REGION_DOWN_LOG_EVERY - 0.25)
        self.routed(mesh, one, home_region="fi")
        self.assertEqual(self.warned(one), 1)
        self.clock.advance(0.25)
        self.routed(mesh, one, home_region="fi")
        self.assertEqual(self.warned(one), 2)


# -- configuration ---------------------------------------------------------------------------------


MESH = {
    "LCHAT_HIBERNATE_BUCKET": "bucket-ie",
    "LCHAT_HIBERNATE_PREFIX": "prod",
    "LCHAT_HIBERNATE_REGION": "eu-west-1",
    "LCHAT_MESH_SELF": "https://box1.example.net",
    "LCHAT_MESH_DOMAINS": "example.com",
    "LCHAT_MESH_TOKEN": "t" * 32,
}


def _load(env: dict[str, str], env_file: str = os.devnull) -> BoxConfig:
    base = {"LCHAT_DATA_DIR": "/tmp", "LCHAT_RUN_DIR": "/tmp"}
    return config.load(env_file=env_file, environ={**base, **env}, systemd_present=False)


class MeshBucketConfigTests(SynchronousTestCase):
    def refused(self, url: str, *words: str) -> str:
        with self.assertRaises(ConfigError) as caught:
            _load({**MESH, "LCHAT_MESH_BUCKET": url})
        message = str(caught.exception)
        self.assertTrue(message.startswith("LCHAT_MESH_BUCKET: "), message)
        for word in words:
            self.assertIn(word, message)
        return message

    def test_unset_the_heartbeats_stay_in_the_hibernation_bucket(self) -> None:
        cfg = _load(MESH)
        assert cfg.mesh is not None and cfg.hibernate is not None
        self.assertIsNone(cfg.mesh.bucket)
        self.assertEqual(
            mesh_bucket(cfg),
            Where("bucket-ie", "prod", "eu-west-1"),
        )
        # The same keys as before LCHAT_MESH_BUCKET existed.
        self.assertEqual(members_prefix(mesh_bucket(cfg)), members_prefix(cfg.hibernate))
        self.assertEqual(members_prefix(mesh_bucket(cfg)), "prod/mesh/members/")
        self.assertIsNone(bucket_key_env(cfg, mesh_bucket(cfg), "LCHAT_MESH_BUCKET"))

    def test_an_s3_url_with_its_own_key_names(self) -> None:
        cfg = _load(
            {
                **MESH,
                "LCHAT_MESH_BUCKET": " s3://mesh-fleet/fleet/one?region=eu-north-1"
                "&endpoint=https://s3.example.net/&access_key_env=MESH_KEY"
                "&secret_key_env=MESH_SECRET ",
            }
        )
        assert cfg.mesh is not None
        expected = Where(
            bucket="mesh-fleet",
            prefix="fleet/one",
            s3_region="eu-north-1",
            endpoint="https://s3.example.net",
            access_key_env="MESH_KEY",
            secret_key_env="MESH_SECRET",
        )
        self.assertEqual(cfg.mesh.bucket, expected)
        self.assertEqual(mesh_bucket(cfg), expected)
        self.assertEqual(parse_where(str(expected)), expected)  # the URL form reads back
        self.assertEqual(members_prefix(mesh_bucket(cfg)), "fleet/one/mesh/members/")
        beat = member_key(mesh_bucket(cfg), "https://box1.example.net")
        self.assertEqual(beat.rpartition("/")[0], "fleet/one/mesh/members")

    def test_a_file_bucket_and_one_without_keys(self) -> None:
        cfg = _load({**MESH, "LCHAT_MESH_BUCKET": "file:/srv/mesh"})
        assert cfg.mesh is not None
        self.assertEqual(cfg.mesh.bucket, Where("file:/srv/mesh"))
        cfg = _load({**MESH, "LCHAT_MESH_BUCKET": "s3://mesh-fleet"})
        assert cfg.mesh is not None and cfg.mesh.bucket is not None
        self.assertEqual((cfg.mesh.bucket.bucket, cfg.mesh.bucket.prefix), ("mesh-fleet", ""))
        self.assertIsNone(
            bucket_key_env(cfg, cfg.mesh.bucket, "LCHAT_MESH_BUCKET")
        )  # the box's own credentials

    def test_refusals_name_the_variable(self) -> None:
        self.refused("s3://mesh-fleet?access_key_env=K", "give both")
        self.refused("s3://mesh-fleet?secret_key_env=S", "give both")
        self.refused("s3://mesh-fleet?access_key_env=1K&secret_key_env=S", "'1K'", "variable name")
        self.refused("s3://mesh-fleet?access_key_env=K&secret_key_env=a-b", "variable name")
        self.refused("http://mesh-fleet", "s3://")
        self.refused("s3://Mesh_Fleet", "bucket name")
        self.refused("s3://mesh-fleet?colour=red", "colour")
        self.refused("s3://mesh-fleet?endpoint=ftp://x", "endpoint")
        self.refused(
            "file:/srv/mesh?access_key_env=K&secret_key_env=S", "file: bucket takes no keys"
        )

    def test_region_bucket_refusals_still_name_their_region(self) -> None:
        hib = {"LCHAT_HIBERNATE_BUCKET": "bucket-ie"}
        for url, word in (
            ("s3://b-fi?access_key_env=K", "give both"),
            ("s3://b-fi?access_key_env=K&secret_key_env=9", "variable name"),
            ("s3://b-fi?colour=red", "colour"),
            ("file:/srv/fi?access_key_env=K&secret_key_env=S", "file: bucket takes no keys"),
        ):
            with self.assertRaises(ConfigError) as caught:
                _load({**hib, "LCHAT_REGION_BUCKETS": f"ie=s3://b-ie,fi={url}"})
            message = str(caught.exception)
            self.assertTrue(message.startswith("LCHAT_REGION_BUCKETS: fi: "), message)
            self.assertIn(word, message)


class BucketKeyEnvTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="keys", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        # The process environment is the test's own: only what a test puts there.
        patcher = mock.patch.dict(os.environ, clear=True)
        patcher.start()
        self.addCleanup(patcher.stop)

    def load(self, file_lines: str, url: str) -> tuple[BoxConfig, Where]:
        env_file = os.path.join(self.dir, "router.env")
        with open(env_file, "w") as f:
            f.write(file_lines)
        cfg = _load({**MESH, "LCHAT_MESH_BUCKET": url}, env_file=env_file)
        assert cfg.mesh is not None and cfg.mesh.bucket is not None
        return cfg, cfg.mesh.bucket

    def test_the_named_variables_from_the_env_file(self) -> None:
        cfg, where = self.load(
            "MESH_KEY=AKFILE\nMESH_SECRET=from-file\nAWS_ACCESS_KEY_ID=AKBOX\nAWS_REGION=eu-west-1\n",
            "s3://mesh-fleet?access_key_env=MESH_KEY&secret_key_env=MESH_SECRET",
        )
        self.assertEqual(
            bucket_key_env(cfg, where, "LCHAT_MESH_BUCKET"),
            {
                "AWS_ACCESS_KEY_ID": "AKFILE",  # not the box's own pair
                "AWS_SECRET_ACCESS_KEY": "from-file",
                "AWS_REGION": "eu-west-1",
            },
        )

    def test_the_process_environment_wins(self) -> None:
        cfg, where = self.load(
            "MESH_KEY=AKFILE\nMESH_SECRET=from-file\n",
            "s3://mesh-fleet?access_key_env=MESH_KEY&secret_key_env=MESH_SECRET",
        )
        os.environ.update(MESH_SECRET="from-process", AWS_SESSION_TOKEN="the-box's")
        self.assertEqual(
            bucket_key_env(cfg, where, "LCHAT_MESH_BUCKET"),
            {"AWS_ACCESS_KEY_ID": "AKFILE", "AWS_SECRET_ACCESS_KEY": "from-process"},
        )

    def test_unset_variables_are_named(self) -> None:
        cfg, where = self.load("", "s3://mesh-fleet?access_key_env=MK&secret_key_env=MS")
        with self.assertRaises(ConfigError) as caught:
            bucket_key_env(cfg, where, "LCHAT_MESH_BUCKET")
        self.assertEqual(
            str(caught.exception), "LCHAT_MESH_BUCKET's keys are in MK and MS, which are unset"
        )
        os.environ["MK"] = "AK"
        os.environ["MS"] = ""  # empty is unset
        with self.assertRaises(ConfigError) as caught:
            bucket_key_env(cfg, where, "LCHAT_MESH_BUCKET")
        self.assertEqual(
            str(caught.exception), "LCHAT_MESH_BUCKET's keys are in MS, which is unset"
        )
        with self.assertRaises(ConfigError) as caught:
            bucket_key_env(cfg, where, "region fi")
        self.assertIn("region fi's keys are in MS", str(caught.exception))


# -- the router: LCHAT_MESH_BUCKET at boot -----------------------------------------------------------


class MeshBucketRouterTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="meshb", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.bucket = os.path.join(self.dir, "bucket")  # the hibernation bucket

    def test_an_unusable_mesh_bucket_stops_the_router_naming_the_variable(self) -> None:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LCHAT_", "AWS_"))}
        env.update(
            PYTHONPATH=ROOT,
            LCHAT_DATA_DIR=self.dir,
            LCHAT_RUN_DIR=self.dir,
            LCHAT_HTTP_ADDR="tcp:0:interface=127.0.0.1",
            LCHAT_HTTPS_ADDR="off",
            LCHAT_WORKERS="1",  # (one process: the default would start one a core)
            LCHAT_HIBERNATE_BUCKET=f"file:{self.bucket}",
            LCHAT_MESH_SELF="http://127.0.0.1:1",
            LCHAT_MESH_DOMAINS="example.com",
            LCHAT_MESH_TOKEN="t" * 32,
            LCHAT_MESH_BUCKET=f"s3://lchat-mesh/fleet?endpoint=http://127.0.0.1:{port}"
            "&region=us-east-1&access_key_env=MESH_KEY&secret_key_env=MESH_SECRET",
            MESH_KEY="test",
            MESH_SECRET="test",
        )
        result = subprocess.run(
            [
                *(sys.executable, "-c", "from twisted.scripts.twistd import run; run()"),
                *("-n", "--pidfile=", "lchat", "--env-file", os.devnull),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=50,
        )
        output = result.stdout + result.stderr
        self.assertEqual(result.returncode, 1, output)
        self.assertIn("LCHAT_MESH_BUCKET=lchat-mesh: the bucket is not usable", output)
        self.assertIn("(check LCHAT_MESH_BUCKET's URL and its credentials)", output)
        self.assertNotIn("LCHAT_HIBERNATE_BUCKET=", output)  # that one is fine
        self.assertNotIn("Traceback", output)

    def config(self, mesh_bucket_url: str, file_lines: str = "") -> BoxConfig:
        env_file = os.path.join(self.dir, "router.env")
        with open(env_file, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.dir}\nLCHAT_RUN_DIR={self.dir}\nLCHAT_UNITS=builtin\n"
                "LCHAT_HTTP_ADDR=tcp:0:interface=127.0.0.1\nLCHAT_HTTPS_ADDR=off\n"
                f"LCHAT_HIBERNATE_BUCKET=file:{self.bucket}\nLCHAT_HIBERNATE_PREFIX=prod\n"
                "LCHAT_MESH_SELF=http://127.0.0.1:1\nLCHAT_MESH_DOMAINS=example.com\n"
                f"LCHAT_MESH_TOKEN={'t' * 32}\nLCHAT_MESH_HEARTBEAT=200ms\n"
                f"LCHAT_MESH_BUCKET={mesh_bucket_url}\n{file_lines}"
            )
        return config.load(env_file=env_file, environ={})

    def test_unset_key_variables_refuse_to_start_naming_them(self) -> None:
        cfg = self.config(
            "s3://lchat-mesh?access_key_env=NO_SUCH_KEY&secret_key_env=NO_SUCH_SECRET"
        )
        with self.assertRaises(ConfigError) as caught:
            build_service(cfg, reactor)
        self.assertIn("NO_SUCH_KEY and NO_SUCH_SECRET", str(caught.exception))

    async def test_the_heartbeats_go_to_the_mesh_bucket(self) -> None:
        moto = await shared_server("moto")
        name = await moto.new_bucket()
        keys = (
            f"MESH_KEY={moto.credentials.access_key}\nMESH_SECRET={moto.credentials.secret_key}\n"
        )
        cfg = self.config(
            f"s3://{name}/fleet?endpoint={moto.endpoint}&region={moto.region}"
            "&access_key_env=MESH_KEY&secret_key_env=MESH_SECRET",
            keys,
        )
        assert cfg.mesh is not None
        service = build_service(cfg, reactor, poll_interval=0.2)
        service.startService()
        stopped: list[bool] = []

        async def stop() -> None:
            if not stopped:
                stopped.append(True)
                await service.stopService()

        self.addCleanup(lambda: Deferred.fromCoroutine(stop()))
        beat = member_key(mesh_bucket(cfg), cfg.mesh.self_url)
        self.assertTrue(beat.startswith("fleet/mesh/members/"), beat)
        s3 = moto.client()

        def listed() -> list[str]:
            found = s3.list_objects_v2(Bucket=name, Prefix="fleet/mesh/members/")
            return [o["Key"] for o in found.get("Contents", [])]

        deadline = time.monotonic() + 15
        keys_found: list[str] = []
        while not keys_found:
            self.assertLess(time.monotonic(), deadline, "no heartbeat in the mesh bucket")
            await deferLater(reactor, 0.1, lambda: None)
            keys_found = await deferToThread(listed)
        self.assertEqual(keys_found, [beat])
        # Not in the hibernation bucket: only the probe's prefix was ever written there.
        local = FileBucket(self.bucket)
        self.assertEqual(local.list("prod/mesh/"), [])
        self.assertEqual(local.list("mesh/"), [])
        await stop()
        # A drain deletes the heartbeat where it wrote it.
        self.assertEqual(await deferToThread(listed), [])

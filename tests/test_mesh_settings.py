"""Per-space settings reach every box (issue 32, item 2): versioned, the owner's word last.

Two real ``twistd lchat`` routers on one bucket (moto; SeaweedFS through
:class:`SettingsSeaweedTests`), ``LCHAT_MESH_SYNC=1s``: a replication-class change, an ``lchat
env`` edit and a hand edit of ``<host>.env`` on one box reach the other; a stale ``mesh-seed``
never reverts a newer setting; a box that was down during a change converges by anti-entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from typing import Any, cast

from attrs import evolve
from prometheus_client import REGISTRY
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import Clock, deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat import config, envfile, hosts
from lchat.cli import provision, space_settings
from lchat.handover.router import Say
from lchat.mesh import api, client, settings
from lchat.mesh.route_payload import parse_payload
from lchat.mesh.route_store import RouteStore
from lchat.mesh.sync import SettingsSync
from lchat.registry import (
    MIGRATIONS,
    SCHEMA_VERSION,
    TOMBSTONE_RETENTION_MS,
    Registry,
    Route,
    UnknownHost,
)
from lchat.threads import thread_runner
from tests import s3servers, test_mesh
from tests import test_mesh_api as api_tests
from tests.meshnet import weed_available as test_mesh_weed_available
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _lchat

reactor: Any = _reactor
HOST = f"set.{DOMAIN}"


def _row(box: Box, host: str = HOST) -> Any:
    return box.registry().get(host)


def _converged(a: Box, b: Box, host: str = HOST) -> bool:
    """Both boxes hold the same settings generation (a versioned one) and hash of ``host``."""
    mine, theirs = _row(a, host), _row(b, host)
    return bool(mine.settings_gen) and (mine.settings_gen, mine.settings_hash) == (
        theirs.settings_gen,
        theirs.settings_hash,
    )


def _settled(a: Box, b: Box, host: str = HOST) -> bool:
    """Both boxes' first sweeps are done and they agree on ``host``'s settings hash. Each box
    adds the space on its own, so until then a sync round may still take the owner's copy,
    rewriting this box's env files (a hand edit made meanwhile is lost, as an edit crossing a
    peer's newer settings is: seen as a stall of the hand-edit test, 1 run in ~8 under load)."""
    mine, theirs = _row(a, host), _row(b, host)
    return mine.settings_hash != "" and mine.settings_hash == theirs.settings_hash


def _env(box: Box, host: str = HOST) -> str:
    try:
        with open(hosts.env_path(box.data, host)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


class SettingsCase(MeshTestCase):
    """Two real routers syncing every second (no tests of its own)."""

    timeout = 120

    @inlineCallbacks
    def two(self, **settings: str) -> Any:
        a, b = self.boxes(2, LCHAT_MESH_SYNC="1s", **settings)
        for box in (a, b):
            box.add_space(HOST)
        yield self.start(a, b)
        return a, b

    @inlineCallbacks
    def settles(self, predicate: Any, ran: Any, a: Box, b: Box, timeout: float = 5.0) -> Any:
        """``predicate`` within ``timeout`` (a push, or box1's next sync round: 1 s); else a
        failure that shows the command's output and both logs' mesh lines."""
        try:
            yield self.wait_for(predicate, timeout=timeout)
        except self.failureException:
            lines = [ln for box in (a, b) for ln in box.log().splitlines() if "mesh" in ln]
            self.fail(ran.stdout + ran.stderr + "\n".join(lines[-60:]))


class SettingsTests(SettingsCase):
    @inlineCallbacks
    def test_replication_class_and_env_changes_reach_every_peer(self) -> Any:
        """``lchat replication h daily`` on box0: box1's row says ``daily`` within 3 s, at box0's
        settings generation; a ``mesh-seed`` from box1 holding an older row is answered
        ``stale`` and box0 keeps ``daily``; ``lchat env`` edits reach box1's env file."""
        a, b = yield self.two()
        ran = yield deferToThread(_lchat, "replication", HOST, "daily", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.wait_for(lambda: _row(b).replication == "daily", timeout=3)
        # Both hold the same generation and hash (box0's router may have taken the change for
        # an edit by hand between the command's two writes, and pushed a generation too).
        yield self.wait_for(lambda: _converged(a, b), timeout=3)
        self.assertIn(f"pushed to {b.url}: updated", ran.stderr)

        # `lchat env h set LCHAT_BUILD=x` on box0: box1's env file has it (values never
        # printed); `unset` takes it away again on both.
        ran = yield deferToThread(
            _lchat, "env", HOST, "set", "LCHAT_BUILD=x", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn("LCHAT_BUILD=x", _env(a))
        yield self.settles(lambda: "LCHAT_BUILD=x" in _env(b), ran, a, b)
        self.assertIn("LCHAT_ADMIN_TOKEN=", _env(b))
        yield self.wait_for(lambda: _converged(a, b), timeout=3)
        listed = yield deferToThread(_lchat, "env", HOST, "--env-file", a.env_file)
        self.assertEqual(listed.stdout.split(), ["LCHAT_ADMIN_TOKEN", "LCHAT_BUILD"])
        self.assertNotIn("ttt", listed.stdout + ran.stdout + ran.stderr)  # never a value
        ran = yield deferToThread(
            _lchat, "env", HOST, "unset", "LCHAT_BUILD", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.wait_for(lambda: "LCHAT_BUILD" not in _env(b), timeout=3)

        # box1 with an older row (as a box that missed the change holds it) seeds box0. Its
        # router is stopped first: running, its anti-entropy would take box0's newer row back.
        yield deferToThread(b.stop)
        gen = _row(a).settings_gen
        # (Row and hash agree, so box1's own sweep sees no edit by hand to push.)
        older = evolve(_row(b), replication="stream")
        env = client.read_route_env(b.data, HOST)
        b.registry().update(
            HOST,
            replication="stream",
            settings_gen=gen - 1,
            settings_hash=settings.route_hash(older, env),
        )
        ran = yield deferToThread(_lchat, "mesh-seed", a.url, "--env-file", b.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn("1 stale", ran.stdout)
        lines = [ln for box in (a, b) for ln in box.log().splitlines() if "mesh" in ln]
        self.assertEqual(
            (_row(a).replication, _row(a).settings_gen),
            ("daily", gen),
            ran.stdout + ran.stderr + "\n".join(lines[-80:]),
        )
        self.assertIn(f"mesh: route {HOST} from a peer is stale", a.log())

    @inlineCallbacks
    def test_a_peer_down_during_the_change_converges_and_hand_edits_travel(self) -> Any:
        """box1 is stopped during a change on box0; started again, it takes the change by
        anti-entropy within the sync interval, with no ``mesh-seed``. A hand edit of box0's
        ``<host>.env`` then reaches box1 by box0's sweep."""
        a, b = yield self.two()
        yield self.wait_for(lambda: _settled(a, b), timeout=5)  # the first sweeps, agreed
        yield deferToThread(b.stop)
        ran = yield deferToThread(_lchat, "replication", HOST, "daily", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertEqual(_row(b).replication, "stream")
        yield self.start(b)
        yield self.wait_for(lambda: _row(b).replication == "daily", timeout=5)
        yield self.wait_for(lambda: _converged(a, b), timeout=3)
        self.assertRegex(b.log(), rf"mesh: {HOST} settings gen \d+ from {a.url} \(was \d+\)")

        with open(hosts.env_path(a.data, HOST), "a") as f:
            f.write("LCHAT_BUILD=by-hand\n")
        yield self.wait_for(lambda: "LCHAT_BUILD=by-hand" in _env(b), timeout=20)
        self.assertIn(f"mesh: {HOST} settings changed on this box", a.log())
        self.assertNotIn("by-hand", a.log() + b.log())  # values are never logged

    @inlineCallbacks
    def test_hand_edits_and_the_bot_env_run_on_the_other_box_after_a_drain(self) -> Any:
        """A hand edit of ``LCHAT_BUILD`` in box0's ``<host>.env`` and a ``<host>-bot.env``
        staged there by hand reach box1 by box0's sweep; box0 drained, a request through box1
        wakes the space there, and it answers with the edited build."""
        a, b = yield self.two()
        yield self.wait_for(lambda: _settled(a, b), timeout=5)  # the first sweeps, agreed
        with open(hosts.env_path(a.data, HOST), "a") as f:
            f.write("LCHAT_BUILD=edited-by-hand\n")
        fd = os.open(hosts.bot_env_path(a.data, HOST), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"LCHAT_BOT_TOKEN=" + b"b" * 32 + b"\n")
        os.close(fd)
        # (A sweep a second, then a push: well under a second on a quiet machine; the bound is
        # for a loaded one, where a router can lag its sweep by seconds.)
        yield self.wait_for(
            lambda: "LCHAT_BUILD=edited-by-hand" in _env(b) and _converged(a, b),
            timeout=20,
            logs=(a, b),
        )
        with open(hosts.bot_env_path(b.data, HOST)) as f:
            self.assertEqual(f.read().split(), ["LCHAT_BOT_TOKEN=" + "b" * 32])
        self.assertEqual(os.stat(hosts.bot_env_path(b.data, HOST)).st_mode & 0o777, 0o600)
        self.assertNotIn("bbbbbbbb", a.log() + b.log())  # values are never logged

        yield deferToThread(a.stop)  # a graceful drain: box1 owns every host now

        def answers() -> bytes | None:
            try:
                status, body, _ = test_mesh.request(b, HOST, ca=self.ca)
            except OSError:
                return None
            return body if status == 200 else None

        body = yield self.wait_for(answers, timeout=8)
        self.assertEqual(json.loads(body)["build"], "edited-by-hand")
        self.assertTrue(b.awake(HOST))

    @inlineCallbacks
    def test_fleet_shows_divergence_then_convergence(self) -> Any:
        """box1 (whose own sync is an hour away) holds older settings than box0: ``lchat fleet``
        names it under ``divergence`` (JSON and the DIVERGED column), exits 4 once that has
        lasted twice box0's LCHAT_MESH_SYNC; after a ``mesh-seed`` to box1, none."""
        a, b = self.boxes(2, LCHAT_MESH_SYNC="1s")
        b.settings = {**b.settings, "LCHAT_MESH_SYNC": "1h"}  # type: ignore[attr-defined]
        for box in (a, b):
            box.add_space(HOST)
        yield self.start(a, b)
        ran = yield deferToThread(_lchat, "replication", HOST, "daily", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.wait_for(lambda: _row(b).replication == "daily", timeout=3)
        yield self.wait_for(lambda: _converged(a, b), timeout=3)
        # As box1 would be had it missed the change (row and hash agree: no edit by hand).
        gen = _row(a).settings_gen
        older = evolve(_row(b), replication="stream")
        b.registry().update(
            HOST,
            replication="stream",
            settings_gen=gen - 1,
            settings_hash=settings.route_hash(older, client.read_route_env(b.data, HOST)),
        )
        yield test_mesh.sleep(max(0.0, gen / 1000 + 2.5 - time.time()))  # past 2 x 1 s
        ran = yield deferToThread(_lchat, "fleet", "--json", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 4, ran.stdout + ran.stderr)
        doc = json.loads(ran.stdout)
        self.assertEqual(doc["divergence"], {HOST: [b.url]})
        self.assertEqual(doc["settings"][HOST][a.url]["replication"], "daily")
        self.assertEqual(doc["settings"][HOST][b.url]["gen"], gen - 1)
        self.assertEqual(doc["settings"][HOST][a.url]["env_keys"], ["LCHAT_ADMIN_TOKEN"])
        self.assertNotIn("ttt", ran.stdout)  # key names, never values
        table = yield deferToThread(_lchat, "fleet", "--env-file", a.env_file)
        self.assertIn(b.url, next(ln for ln in table.stdout.splitlines() if HOST in ln))

        ran = yield deferToThread(_lchat, "mesh-seed", b.url, "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        ran = yield deferToThread(_lchat, "fleet", "--json", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertEqual(json.loads(ran.stdout)["divergence"], {})

    @inlineCallbacks
    def test_a_box_down_at_a_create_and_a_remove_converges_without_mesh_seed(self) -> Any:
        """box1 stopped, ``add-instance --hibernate`` on box0 says box1 is down (registered on
        1/2 boxes); box1 started again serves the new space within a few seconds (its
        anti-entropy creates the row, env file included), no ``mesh-seed``. Stopped again, a
        ``remove`` on box0; box1 started again drops the row (box0's tombstone), keeping none of
        its replicated files."""
        a, b = yield self.two()
        new = f"missed.{DOMAIN}"
        yield deferToThread(b.stop, signal.SIGKILL)  # its beat stays: a member, down
        ran = yield deferToThread(
            _lchat, "add-instance", new, "--hibernate", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertRegex(
            ran.stdout + ran.stderr, rf"registered on 1/2 boxes \({b.url}: [^)]*converges"
        )
        self.assertIsNone(b.registry().get(new))
        yield self.start(b)
        yield self.settles(lambda: b.registry().get(new) is not None, ran, a, b)
        status, body, _ = yield self.req(b, new, "/api/rooms/r/messages")
        self.assertEqual(status, 200, body)
        self.assertIn(f"mesh: {new} created from {a.url} (missed at its creation", b.log())
        self.assertIn("LCHAT_ADMIN_TOKEN=", _env(b, new))

        yield deferToThread(b.stop, signal.SIGKILL)  # its beat stays: a member, down
        ran = yield deferToThread(_lchat, "remove", new, "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.start(b)
        yield self.settles(lambda: b.registry().get(new) is None, ran, a, b)
        self.assertEqual(_env(b, new), "")
        # (The line follows the delete's commit: on a loaded machine, a moment after the row
        # is gone.)
        removed = rf"mesh: {new} removed: {a.url} deleted it \(gen \d+"
        yield self.wait_for(lambda: re.search(removed, b.log()), timeout=10, logs=(b,))
        yield test_mesh.sleep(1.5)  # a's next round: box1's digest never brings it back
        self.assertIsNone(a.registry().get(new))


class RegionGenerationTests(SettingsCase):
    @inlineCallbacks
    def test_an_env_edit_on_a_box_that_missed_a_relocate_keeps_the_new_region(self) -> Any:
        """box1 is down while box0's row moves to home region ``fi`` (a relocate's flip of the
        column; box0's sweep gives it a generation and pushes: box1 misses it). ``lchat env`` on
        box1 then makes a newer change from the old region: box0 takes the env edit and keeps
        ``fi`` (the region's own generation is newer); box1, started, takes ``fi`` from box0's
        digest. Both end with ``fi`` and the edit, at one generation and hash."""
        a, b = yield self.two()
        yield self.wait_for(lambda: _settled(a, b), timeout=5)  # the first sweeps, agreed
        yield deferToThread(b.stop)
        moved = a.registry().update(HOST, home_region="fi")  # as relocate's flip writes it
        self.assertGreater(moved.region_gen, 0)
        yield self.wait_for(lambda: _row(a).settings_gen >= moved.region_gen, timeout=5)
        self.assertEqual(_row(b).home_region, "")  # missed
        ran = yield deferToThread(
            _lchat, "env", HOST, "set", "LCHAT_BUILD=from-b", "--env-file", b.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn(f"pushed to {a.url}: updated", ran.stderr)
        self.assertGreater(_row(b).settings_gen, _row(a).region_gen)  # the newer change
        yield self.start(b)

        def converged() -> bool:
            return (
                _converged(a, b)
                and (_row(a).home_region, _row(b).home_region) == ("fi", "fi")
                and "LCHAT_BUILD=from-b" in _env(a)
                and "LCHAT_BUILD=from-b" in _env(b)
            )

        yield self.settles(converged, ran, a, b)
        self.assertEqual(_row(b).region_gen, _row(a).region_gen)
        # box0 kept its region from box1's push; box1 took it by anti-entropy (the region alone,
        # or the whole row when box0 is the owner by the hash: the tie of generations).
        self.assertIn(f"mesh: route {HOST} from a peer: its settings (gen", a.log())
        self.assertIn("but not its home region - (region gen 0)", a.log())
        self.assertRegex(b.log(), rf"mesh: {HOST} settings gen \d+ from {a.url}")


class SettingsSeaweedTests(SettingsCase):
    """The pushes and the stale seed on SeaweedFS. The anti-entropy, the hand edits and the fleet
    view talk to no bucket (peer to peer over the mesh API), so they run on moto only: the suite's
    budget of real-router time."""

    test_replication_class_and_env_changes_reach_every_peer = (
        SettingsTests.test_replication_class_and_env_changes_reach_every_peer
    )

    skip = None if test_mesh_weed_available() else "SeaweedFS's weed is not installed"

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()


# --- the anti-entropy's logic, on a fake clock, against a real mesh API -------------------------


def _sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


class SyncTests(TestCase):
    """:class:`lchat.mesh.sync.SettingsSync` of box-2, its rounds on a ``task.Clock``, pulling
    over real HTTP from box-1's real mesh API (tests.test_mesh_api.Served)."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="msync", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.peer = api_tests.Box(self.root, "box-1")
        self.served = api_tests.Served(self, self.peer)
        self.here = api_tests.Box(self.root, "box-2", LCHAT_MESH_SYNC="10s")
        cfg = self.here.cfg()
        assert cfg.mesh is not None
        self.mesh = cfg.mesh
        self.api = api.MeshAPI(
            self.here.registry, cfg, lambda reason: None, run_in_thread=thread_runner(reactor)
        )
        self.clock = Clock()
        self.jitter = 0.5
        self.now_ms = 1_000
        self.members = [api_tests.member(self.served.url)]

    def sync(self) -> SettingsSync:
        sync = SettingsSync(
            reactor,
            self.clock,
            self.mesh,
            self.here.data,
            self.here.registry,
            lambda: self.members,
            lambda route: "https://nobody.example.net",
            self.api.apply,
            run_in_thread=thread_runner(reactor),
            apply_delete=self.api.apply_delete,
            jitter=lambda: self.jitter,
            now_ms=lambda: self.now_ms,
        )
        sync.startService()
        self.addCleanup(sync.stopService)
        return sync

    def both(self, gen: int, replication: str = "daily") -> None:
        """box-2 holds the row at generation 1; box-1 at ``gen`` with ``replication``."""
        for box in (self.here, self.peer):
            route = box.add(api_tests.HOST)
            settings.bump(box.registry, box.data, "http://x.example.net", route, 1)
        route = self.peer.registry.update(api_tests.HOST, replication=replication)
        self.peer.registry.update(api_tests.HOST, settings_gen=gen - 1)
        settings.bump(self.peer.registry, self.peer.data, "http://x", route, gen)

    @inlineCallbacks
    def round_done(self, sync: SettingsSync) -> Any:
        while sync._round is not None:
            yield deferLater(reactor, 0.01, lambda: None)

    def test_rounds_are_jittered_around_the_interval(self) -> None:
        for jitter, delay in ((0.0, 7.5), (0.5, 10.0), (0.999, 12.495)):
            self.jitter = jitter
            sync = self.sync()
            (call,) = self.clock.getDelayedCalls()
            self.assertAlmostEqual(call.getTime() - self.clock.seconds(), delay, places=2)
            sync.stopService()
            self.assertEqual(self.clock.getDelayedCalls(), [])

    @inlineCallbacks
    def test_a_newer_generation_is_pulled_and_applied(self) -> Any:
        self.both(gen=500)
        applied = _sample("lchat_mesh_sync_applied_total", kind="settings")
        sync = self.sync()
        self.clock.advance(9.9)
        self.assertIsNone(sync._round)
        self.clock.advance(0.2)
        yield self.round_done(sync)
        row = self.here.registry.get(api_tests.HOST)
        assert row is not None
        self.assertEqual((row.replication, row.settings_gen), ("daily", 500))
        self.assertEqual(_sample("lchat_mesh_sync_applied_total", kind="settings"), applied + 1)
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)  # the next round, scheduled
        # Nothing newer there: the next round takes nothing.
        self.clock.advance(10.0)
        yield self.round_done(sync)
        self.assertEqual(_sample("lchat_mesh_sync_applied_total", kind="settings"), applied + 1)

    @inlineCallbacks
    def test_an_older_peer_copy_is_left_and_a_host_missed_is_created(self) -> Any:
        for box in (self.here, self.peer):
            route = box.add(api_tests.HOST)
            settings.bump(box.registry, box.data, "http://x", route, 900 if box is self.here else 5)
        other = f"other.{api_tests.DOMAIN}"
        self.peer.add(other)
        settings.bump(
            self.peer.registry,
            self.peer.data,
            "http://x",
            self.peer.registry.get(other),  # type: ignore[arg-type]
            7,
        )
        created = _sample("lchat_mesh_sync_applied_total", kind="created")
        sync = self.sync()
        yield sync.sync_once()
        row = self.here.registry.get(api_tests.HOST)
        assert row is not None
        self.assertEqual(row.settings_gen, 900)
        # The host this box missed at its creation: created here, row and env file, as a push.
        made = self.here.registry.get(other)
        assert made is not None
        self.assertEqual((made.settings_gen, made.hibernate, made.status), (7, True, "ready"))
        with open(self.here.env_path(other)) as f:
            self.assertEqual(f.read(), f"LCHAT_ADMIN_TOKEN=tok-{other}\n")
        self.assertEqual(_sample("lchat_mesh_sync_applied_total", kind="created"), created + 1)
        yield sync.sync_once()  # held now: nothing more to take
        self.assertEqual(_sample("lchat_mesh_sync_applied_total", kind="created"), created + 1)

    @inlineCallbacks
    def test_a_peer_tombstone_removes_the_row_and_keeps_member_data(self) -> Any:
        for box in (self.here, self.peer):
            settings.bump(box.registry, box.data, "http://x", box.add(api_tests.HOST), 5)
        with open(hosts.db_path(self.here.data, api_tests.HOST), "wb") as f:
            f.write(b"members")
        removed = self.peer.registry.delete_with_tombstone(api_tests.HOST, 50)
        assert removed is not None
        self.assertEqual(removed[1].gen, 50)
        deleted = _sample("lchat_mesh_sync_applied_total", kind="deleted")
        sync = self.sync()
        yield sync.sync_once()
        self.assertIsNone(self.here.registry.get(api_tests.HOST))
        self.assertFalse(os.path.exists(self.here.env_path(api_tests.HOST)))
        self.assertTrue(os.path.exists(hosts.db_path(self.here.data, api_tests.HOST)))
        tomb = self.here.registry.tombstone(api_tests.HOST)
        assert tomb is not None
        self.assertEqual(tomb.gen, 50)  # the peer's: both boxes hold the same tombstone
        self.assertEqual(_sample("lchat_mesh_sync_applied_total", kind="deleted"), deleted + 1)

    @inlineCallbacks
    def test_a_stale_copy_never_brings_a_removed_row_back_and_a_re_add_does(self) -> Any:
        for box in (self.here, self.peer):
            settings.bump(box.registry, box.data, "http://x", box.add(api_tests.HOST), 5)
        self.here.registry.delete_with_tombstone(api_tests.HOST, 50)  # the peer missed it
        sync = self.sync()
        yield sync.sync_once()
        self.assertIsNone(self.here.registry.get(api_tests.HOST))
        # Nor does a push of the old copy (the same upsert path): answered stale.
        payload = client.route_payload(self.peer.registry.get(api_tests.HOST), {})  # type: ignore[arg-type]
        answer = yield deferToThread(lambda: self.api._store.upsert(parse_payload(payload)))
        self.assertEqual(answer[1], {"host": api_tests.HOST, "result": "stale", "gen": 50})
        self.assertIsNone(self.here.registry.get(api_tests.HOST))
        # The peer takes the tombstone from this box's digest (its own sync), member data kept.
        peer_api = api.MeshAPI(
            self.peer.registry,
            self.peer.cfg(),
            lambda r: None,
            run_in_thread=thread_runner(reactor),
        )
        here_served = api_tests.Served(self, self.here)
        peer_sync = SettingsSync(
            reactor,
            Clock(),
            self.peer.cfg().mesh,  # type: ignore[arg-type]
            self.peer.data,
            self.peer.registry,
            lambda: [api_tests.member(here_served.url)],
            lambda route: "https://nobody.example.net",
            peer_api.apply,
            run_in_thread=thread_runner(reactor),
            apply_delete=peer_api.apply_delete,
            now_ms=lambda: 1_000,
        )
        yield peer_sync.sync_once()
        self.assertIsNone(self.peer.registry.get(api_tests.HOST))
        # Added again on the peer: above the tombstone it holds now, so it comes back here.
        route = self.peer.add(api_tests.HOST)
        again = settings.bump(self.peer.registry, self.peer.data, "http://x", route, 20)
        self.assertEqual(again.settings_gen, 51)
        self.assertIsNone(self.peer.registry.tombstone(api_tests.HOST))
        yield sync.sync_once()
        row = self.here.registry.get(api_tests.HOST)
        assert row is not None
        self.assertEqual(row.settings_gen, 51)
        self.assertIsNone(self.here.registry.tombstone(api_tests.HOST))

    @inlineCallbacks
    def test_a_row_older_than_the_retention_is_not_created_and_old_tombstones_go(self) -> Any:
        settings.bump(self.peer.registry, self.peer.data, "x", self.peer.add(api_tests.HOST), 5)
        self.here.registry.record_tombstone(f"gone.{api_tests.DOMAIN}", 6, "")
        self.now_ms = 7 + TOMBSTONE_RETENTION_MS
        purged = _sample("lchat_mesh_tombstones_purged_total")
        sync = self.sync()
        yield sync.sync_once()
        self.assertIsNone(self.here.registry.get(api_tests.HOST))  # `lchat mesh-seed` takes it
        self.assertEqual(self.here.registry.tombstones(), {})
        self.assertEqual(_sample("lchat_mesh_tombstones_purged_total"), purged + 1)

    @inlineCallbacks
    def test_an_older_peer_digest_without_tombstones(self) -> Any:
        """A peer from before tombstones answers ``?tombstones=1`` with its rows alone: this box
        creates what it missed, and a row it removed stays removed (its own tombstone)."""
        # The peer's API as an older lchat serves it: the query ignored, the rows' shape.
        resource: api.MeshAPI = self.served.site.resource
        store = resource._store
        older = RouteStore.digest
        store.digest = lambda with_tombstones=False: older(store)  # type: ignore[method-assign]
        for host, gen in ((api_tests.HOST, 5), (f"other.{api_tests.DOMAIN}", 8)):
            settings.bump(self.peer.registry, self.peer.data, "x", self.peer.add(host), gen)
        self.peer.registry.record_tombstone(f"gone.{api_tests.DOMAIN}", 9, "")  # never sent
        self.here.registry.record_tombstone(api_tests.HOST, 50, "")
        rows, buried, _ = yield Deferred.fromCoroutine(
            client.settings_digest_and_tombstones(self.served.url, api_tests.TOKEN, reactor=reactor)
        )
        self.assertEqual(set(rows), {api_tests.HOST, f"other.{api_tests.DOMAIN}"})
        self.assertEqual(buried, {})
        sync = self.sync()
        yield sync.sync_once()
        self.assertIsNone(self.here.registry.get(api_tests.HOST))
        self.assertIsNotNone(self.here.registry.get(f"other.{api_tests.DOMAIN}"))

    @inlineCallbacks
    def test_a_repair_takes_one_hosts_newer_row_at_once_and_joins_a_second_call(self) -> Any:
        self.both(gen=500)
        updated = _sample("lchat_mesh_sync_repairs_total", result="updated")
        sync = self.sync()
        first = sync.repair(api_tests.HOST)
        self.assertIs(sync.repair(api_tests.HOST), first)  # one repair per host at a time
        yield first
        row = self.here.registry.get(api_tests.HOST)
        assert row is not None
        self.assertEqual((row.replication, row.settings_gen), ("daily", 500))
        self.assertEqual(_sample("lchat_mesh_sync_repairs_total", result="updated"), updated + 1)
        self.assertIsNone(sync._round)  # no round was run for it
        # Nothing newer there now: unchanged, and nothing applied.
        unchanged = _sample("lchat_mesh_sync_repairs_total", result="unchanged")
        yield sync.repair(api_tests.HOST)
        self.assertEqual(
            _sample("lchat_mesh_sync_repairs_total", result="unchanged"), unchanged + 1
        )

    @inlineCallbacks
    def test_a_repair_from_an_unreachable_peer_fails_quietly(self) -> Any:
        self.both(gen=500)
        self.members = [api_tests.member("http://127.0.0.1:1")]
        failed = _sample("lchat_mesh_sync_repairs_total", result="failed")
        sync = self.sync()
        sync.timeout = 2.0
        yield sync.repair(api_tests.HOST)
        self.assertEqual(_sample("lchat_mesh_sync_repairs_total", result="failed"), failed + 1)
        row = self.here.registry.get(api_tests.HOST)
        assert row is not None
        self.assertEqual(row.settings_gen, 1)

    @inlineCallbacks
    def test_a_peers_newer_region_alone_is_pulled_under_an_older_generation(self) -> Any:
        """The peer relocated the space (region gen 500); this box missed it and made a newer
        change of its own (gen 900): the peer's digest names the newer region (``regions``), so
        a round fetches the row and takes the region alone, keeping this box's generation."""
        for box in (self.here, self.peer):
            settings.bump(box.registry, box.data, "http://x", box.add(api_tests.HOST), 1)
        moved = evolve(_get(self.peer), home_region="fi")
        settings.bump(self.peer.registry, self.peer.data, "http://x", moved, 500)
        settings.bump(self.here.registry, self.here.data, "http://x", _get(self.here), 900)
        _, body, _ = self.served.site.resource._store.digest(with_tombstones=True)
        self.assertEqual(body["regions"], {api_tests.HOST: 500})
        taken = _sample("lchat_mesh_home_region_merges_total", result="taken")
        sync = self.sync()
        yield sync.sync_once()
        row = _get(self.here)
        self.assertEqual((row.home_region, row.region_gen, row.settings_gen), ("fi", 500, 900))
        self.assertEqual(_sample("lchat_mesh_home_region_merges_total", result="taken"), taken + 1)

    @inlineCallbacks
    def test_an_unreachable_peer_is_counted(self) -> Any:
        self.members = [api_tests.member("http://127.0.0.1:1")]
        failed = _sample("lchat_mesh_sync_failures_total", peer="http://127.0.0.1:1")
        sync = self.sync()
        yield sync.sync_once()
        self.assertEqual(
            _sample("lchat_mesh_sync_failures_total", peer="http://127.0.0.1:1"), failed + 1
        )


# --- lchat env, and the registry's generations (no router) -------------------------------------


class EnvCommandTests(api_tests.CliTestCase):
    """``lchat env`` against a peer's real mesh API (tests.test_mesh_api.CliTestCase)."""

    @inlineCallbacks
    def test_set_and_unset_push_a_new_generation_and_never_print_values(self) -> Any:
        api_tests.beat(self.a, self.peer.url, "fi")
        host = api_tests.HOST
        self.a.add(host)
        done = yield self.lchat("env", host, "set", "LCHAT_BUILD=secret-build", "LCHAT_X=1")
        self.assertEqual(done.returncode, 0, done)
        self.assertIn(f"mesh: {host}: pushed to {self.peer.url}: created", done.stderr)
        self.assertNotIn("secret-build", done.stdout + done.stderr)
        here = self.a.registry.get(host)
        there = self.b.registry.get(host)
        assert here is not None and there is not None
        self.assertGreater(here.settings_gen, 0)
        self.assertEqual(
            (there.settings_gen, there.settings_hash), (here.settings_gen, here.settings_hash)
        )
        self.assertEqual(
            config.read_env_file(self.b.env_path(host)),
            {"LCHAT_ADMIN_TOKEN": f"tok-{host}", "LCHAT_BUILD": "secret-build", "LCHAT_X": "1"},
        )
        # The operator's other lines stay on this box, untouched.
        self.assertEqual(config.read_env_file(self.a.env_path(host))["OTHER"], "kept-here")
        done = yield self.lchat("env", host, "unset", "LCHAT_X")
        self.assertEqual(done.returncode, 0, done)
        self.assertNotIn("LCHAT_X", config.read_env_file(self.b.env_path(host)))
        listed = yield self.lchat("env", host)
        self.assertEqual(listed.stdout.split(), ["LCHAT_ADMIN_TOKEN", "LCHAT_BUILD", "OTHER"])

    @inlineCallbacks
    def test_refusals_change_nothing(self) -> Any:
        host = api_tests.HOST
        self.a.add(host)
        before = self.a.files()
        for argv, fragment in (
            (("set", "PATH=/x"), "is not a space setting"),
            (("set", "LCHAT_DB=/x"), "is not a space setting"),
            (("set", "LCHAT_X"), "is not NAME=VALUE"),
            (("unset", "LCHAT_X=1"), "is not NAME (no value)"),
            (("set",), "name at least one variable"),
            (("set", "LCHAT_X=a\u2028b"), "line break"),
        ):
            done = yield self.lchat("env", host, *argv)
            self.assertEqual(done.returncode, 1, done)
            self.assertIn(fragment, done.stderr)
            self.assertEqual(len(done.stderr.strip().splitlines()), 1, done.stderr)
        done = yield self.lchat("env", f"nothere.{api_tests.DOMAIN}", "set", "LCHAT_X=1")
        self.assertIn("is not registered", done.stderr)
        self.assertEqual(self.a.files(), before)
        self.assertEqual(self.a.registry.get(host).settings_gen, 0)  # type: ignore[union-attr]


class _SignallingRegistry(Registry):
    """The real registry, which says when a write asks for its transaction (before it waits for
    one under way): the race test's proof that a peer's copy reached the registry's lock."""

    def __init__(self, path: str, clock: Any, asked: threading.Event) -> None:
        super().__init__(path, clock)
        self._asked = asked

    def transaction(self) -> Any:
        self._asked.set()
        return super().transaction()


class EnvRaceTests(SynchronousTestCase):
    """``lchat env`` and ``lchat invite`` while the owner's older copy of the space lands (a push
    or an anti-entropy pull through the route store): real files, a real registry, fake clocks,
    and the landing forced between the env file's change and its generation (the commands'
    seams)."""

    def race(self, **seam: Any) -> tuple[Any, Any, list[Any], list[str]]:
        """A box whose space's owner has an older copy (gen 3000, the replication class changed)
        ready to land; ``seam``: the Context seam to wrap (``edit_env`` or ``mint_invite``),
        given as the real function. Returns (box, ctx, landed, out): the command, run with
        ctx, lands the copy from another thread right after its change and waits until the copy
        landed (before the fix) or asked for the registry's lock (after it)."""
        ((name, real),) = seam.items()
        root = tempfile.mkdtemp(prefix="mrace", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        box = api_tests.Box(root, "box-1")
        os.makedirs(os.path.join(root, "bucket"))  # the router would have made it (no peers)
        cfg = box.cfg()
        assert cfg.mesh is not None
        host = api_tests.HOST
        here = settings.bump(box.registry, box.data, cfg.mesh.self_url, box.add(host), 1_000)
        owner_row = evolve(here, replication="daily", settings_gen=3_000)
        older = parse_payload(client.route_payload(owner_row, {"LCHAT_ADMIN_TOKEN": f"tok-{host}"}))
        reached = threading.Event()
        store = RouteStore(
            _SignallingRegistry(box.registry.path, lambda: 7.0, reached),
            cfg.mesh,
            box.data,
            box.run,
            cfg.space_command,
        )
        landed: list[Any] = []

        def land() -> None:
            try:
                landed.append(store.upsert(older, from_owner=True))
            finally:
                reached.set()

        def change_then_land(*args: Any) -> Any:
            result = real(*args)
            worker = threading.Thread(target=land)
            worker.start()
            landed.append(worker)
            self.assertTrue(reached.wait(10))
            return result

        out: list[str] = []
        ctx = space_settings.Context(
            lambda args: cfg,
            lambda cfg: Registry(box.registry.path, clock=lambda: 7.0),
            lambda cfg: None,
            Say(out=out.append, note=out.append, warn=out.append),
            now_ms=lambda: 5_000,
            **{name: change_then_land},
        )
        return box, ctx, landed, out

    def settled(self, box: Any, landed: list[Any], out: list[str]) -> tuple[Any, dict[str, str]]:
        """The row and env file once the copy's landing ended; its generation is above the
        copy's, its hash the env as held, and the copy was answered stale."""
        worker, *_ = landed
        worker.join(10)
        row = box.registry.get(api_tests.HOST)
        assert row is not None
        on_disk = config.read_env_file(box.env_path(api_tests.HOST))
        self.assertGreater(row.settings_gen, 3_000, out)
        self.assertEqual(
            row.settings_hash,
            settings.route_hash(row, client.replicable_env(on_disk)),
        )
        self.assertEqual(landed[1][1]["result"], "stale", landed)
        self.assertEqual(row.replication, "stream")
        return row, on_disk

    def test_an_older_copy_landing_mid_edit_neither_loses_the_edit_nor_takes_its_gen(self) -> None:
        box, ctx, landed, out = self.race(edit_env=envfile.edit)
        args = argparse.Namespace(host=api_tests.HOST, action="set", items=["LCHAT_BUILD=edited"])
        self.assertEqual(space_settings.env(args, ctx), 0)
        _, on_disk = self.settled(box, landed, out)
        self.assertEqual(on_disk.get("LCHAT_BUILD"), "edited", out)

    def test_an_older_copy_landing_mid_invite_keeps_the_new_invites_hash(self) -> None:
        """Before: the copy put the env back without the invite's hash, so the link printed
        did not work (or, with --rotate, the old one's hash came back)."""
        box, ctx, landed, out = self.race(mint_invite=provision.mint_invite)
        args = argparse.Namespace(host=api_tests.HOST, rotate=False)
        self.assertEqual(space_settings.invite(args, ctx), 0)
        _, on_disk = self.settled(box, landed, out)
        (link,) = [line for line in out if line.startswith("setup invite: ")]
        invite = link.rsplit("#", 1)[1]
        self.assertEqual(on_disk.get(provision.INVITE_VAR), provision.invite_hash(invite), out)


class RegionMergeTests(SynchronousTestCase):
    """The home region's own generation (lchat.mesh.settings.region_newer) through two boxes'
    real route stores and registries: the merge each box makes is the same, so they converge."""

    def test_the_region_rule(self) -> None:
        row = Route(host=api_tests.HOST, kind="instance", socket="/s", region_gen=50)
        for region_gen, whole, taken in (
            (60, False, True),  # a newer region, whatever the rest
            (40, True, False),  # an older region under newer other settings: kept
            (50, True, True),  # the same region change: the whole row's order
            (50, False, False),
            (None, True, True),  # an older peer's payload: the whole row's order, as before
            (None, False, False),
        ):
            self.assertEqual(settings.region_newer(row, region_gen, whole), taken, region_gen)

    def test_a_relocate_and_a_newer_unrelated_change_merge_field_wise(self) -> None:
        root = tempfile.mkdtemp(prefix="mregion", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        host = api_tests.HOST
        boxes = [api_tests.Box(root, name) for name in ("box-1", "box-2")]
        for box in boxes:
            settings.bump(box.registry, box.data, "http://x", box.add(host), 1_000)
        moved, edited = boxes
        # box-1 relocates (a change of the region, bumped); box-2 missed it, edits its env later.
        flipped = evolve(_get(moved), home_region="fi")
        relocated = settings.bump(moved.registry, moved.data, "http://x", flipped, 2_000)
        self.assertEqual((relocated.region_gen, relocated.settings_gen), (2_000, 2_000))
        with open(edited.env_path(host), "a") as f:
            f.write("LCHAT_BUILD=edited\n")
        change = settings.bump(edited.registry, edited.data, "http://x", _get(edited), 3_000)
        self.assertEqual((change.home_region, change.region_gen), ("", 0))

        def push(sender: Any, to: Any) -> Any:
            cfg = to.cfg()
            store = RouteStore(to.registry, cfg.mesh, to.data, to.run, cfg.space_command)
            row = _get(sender)
            env = client.read_route_env(sender.data, host)
            return store.upsert(parse_payload(client.route_payload(row, env)))

        kept = _sample("lchat_mesh_home_region_merges_total", result="kept")
        taken = _sample("lchat_mesh_home_region_merges_total", result="taken")
        # box-2's newer change reaches box-1: its env taken, box-1's newer region kept.
        self.assertEqual(push(edited, moved)[1]["result"], "updated")
        row = _get(moved)
        self.assertEqual((row.home_region, row.region_gen, row.settings_gen), ("fi", 2_000, 3_000))
        self.assertEqual(config.read_env_file(moved.env_path(host))["LCHAT_BUILD"], "edited")
        self.assertEqual(_sample("lchat_mesh_home_region_merges_total", result="kept"), kept + 1)
        # box-1's merged row reaches box-2 (an equal generation, not from the owner): the region
        # alone is taken, and both hold the same settings under the same generation and hash.
        self.assertEqual(push(moved, edited)[1]["result"], "updated")
        there = _get(edited)
        self.assertEqual(
            (there.home_region, there.region_gen, there.settings_gen), ("fi", 2_000, 3_000)
        )
        self.assertEqual(there.settings_hash, _get(moved).settings_hash)
        self.assertEqual(
            there.settings_hash,
            settings.route_hash(there, client.read_route_env(edited.data, host)),
        )
        self.assertEqual(_sample("lchat_mesh_home_region_merges_total", result="taken"), taken + 1)
        # Converged: each box's copy changes nothing on the other (the same settings again).
        held = (_get(moved), _get(edited))
        push(moved, edited)
        push(edited, moved)
        self.assertEqual(
            [(r.home_region, r.region_gen, r.settings_gen, r.settings_hash) for r in held],
            [
                (r.home_region, r.region_gen, r.settings_gen, r.settings_hash)
                for r in map(_get, (moved, edited))
            ],
        )


def _get(box: Any, host: str = api_tests.HOST) -> Route:
    row = box.registry.get(host)
    assert row is not None
    return row


class HandEditOverwrittenTests(SynchronousTestCase):
    """An env file edited by hand and not yet noticed by the sync, which a peer's newer settings
    replace: the edit is lost (the owner's and the newest settings' word last, by design), and
    the operator is told so (a warning naming the host, a counter), never silently."""

    def _push(self, sender: Any, to: Any) -> Any:
        cfg = to.cfg()
        store = RouteStore(to.registry, cfg.mesh, to.data, to.run, cfg.space_command)
        env = client.read_route_env(sender.data, api_tests.HOST)
        return store.upsert(parse_payload(client.route_payload(_get(sender), env)))

    def test_a_hand_edit_a_newer_copy_replaces_is_told(self) -> None:
        from twisted.logger import ILogObserver, globalLogPublisher

        root = tempfile.mkdtemp(prefix="mhand", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        host = api_tests.HOST
        changed, edited = boxes = [api_tests.Box(root, name) for name in ("box-1", "box-2")]
        for box in boxes:
            settings.bump(box.registry, box.data, "http://x", box.add(host), 1_000)
        said: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "lchat.mesh.api":
                said.append(str(event.get("log_format", "")).format(**event))

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        lost = _sample("lchat_mesh_local_edits_overwritten_total")
        # A newer copy over env files as versioned: nothing to tell.
        with open(changed.env_path(host), "a") as f:
            f.write("LCHAT_BUILD=first\n")
        settings.bump(changed.registry, changed.data, "http://x", _get(changed), 2_000)
        self.assertEqual(self._push(changed, edited)[1]["result"], "updated")
        self.assertEqual(_sample("lchat_mesh_local_edits_overwritten_total"), lost)
        self.assertFalse([line for line in said if "replaced the edit" in line])
        # box-2 is edited by hand (not versioned yet) as box-1's newer change arrives.
        with open(edited.env_path(host), "a") as f:
            f.write("LCHAT_BUILD=by-hand\n")
        with open(changed.env_path(host), "a") as f:
            f.write("LCHAT_BUILD=second\n")
        settings.bump(changed.registry, changed.data, "http://x", _get(changed), 3_000)
        self.assertEqual(self._push(changed, edited)[1]["result"], "updated")
        self.assertEqual(config.read_env_file(edited.env_path(host))["LCHAT_BUILD"], "second")
        self.assertEqual(_sample("lchat_mesh_local_edits_overwritten_total"), lost + 1)
        warned = [line for line in said if "replaced the edit" in line]
        self.assertEqual(len(warned), 1, said)
        self.assertIn(host, warned[0])
        self.assertIn("gen 3000", warned[0])
        self.assertIn("lchat env", warned[0])


class RegistryGenerationTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mgen", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.box = api_tests.Box(self.root, "box-1")

    def test_a_bump_is_lamport(self) -> None:
        self.box.add(api_tests.HOST)
        registry = self.box.registry

        def bump(digest: str, now_ms: int, **kw: Any) -> tuple[int, str] | None:
            row = registry.bump_settings(api_tests.HOST, digest, now_ms, **kw)
            return None if row is None else (row.settings_gen, row.settings_hash)

        self.assertEqual(bump("h1", 1_000), (1_000, "h1"))
        # A clock behind the last writer's still moves the generation forward.
        self.assertEqual(bump("h2", 500), (1_001, "h2"))
        self.assertEqual(bump("h3", 5_000), (5_000, "h3"))
        # The sweep's compare-and-swap: only over what it read.
        self.assertIsNone(bump("h4", 6_000, expect=(1_001, "h2")))
        self.assertEqual(bump("h4", 6_000, expect=(5_000, "h3")), (6_000, "h4"))
        self.assertEqual(bump("h5", 9_000, expect=(6_000, "h4"), keep_gen=True), (6_000, "h5"))
        with self.assertRaises(UnknownHost):
            registry.bump_settings(f"none.{api_tests.DOMAIN}", "h", 1)

    def test_the_migration_gives_old_rows_no_generation(self) -> None:
        path = os.path.join(self.root, "old.db")
        conn = sqlite3.connect(path, isolation_level=None)
        for version in range(SCHEMA_VERSION - 1):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
        conn.execute(
            "INSERT INTO routes (host, kind, socket, status, hibernate) "
            "VALUES ('a.chat.example.com', 'instance', '/run/x.sock', 'ready', 1)"
        )
        conn.close()
        registry = Registry(path, clock=time.time)
        self.assertEqual(registry.migrate(), SCHEMA_VERSION - 1)
        row = registry.get("a.chat.example.com")
        assert row is not None
        self.assertEqual((row.settings_gen, row.settings_hash), (0, ""))

    def test_hashes_cover_what_travels_only(self) -> None:
        row = self.box.add(api_tests.HOST)
        env = {"LCHAT_ADMIN_TOKEN": "t"}
        base = settings.route_hash(row, env)
        self.assertEqual(base, settings.route_hash(evolve(row, socket="/elsewhere.sock"), env))
        self.assertEqual(base, settings.route_hash(evolve(row, next_due=7, status="failed"), env))
        for changed in (
            settings.route_hash(evolve(row, replication="daily"), env),
            settings.route_hash(evolve(row, home_region="fi"), env),
            settings.route_hash(evolve(row, version="2"), env),
            settings.route_hash(row, {"LCHAT_ADMIN_TOKEN": "u"}),
            settings.route_hash(row, env, {"LCHAT_BOT_TOKEN": "b"}),
        ):
            self.assertNotEqual(changed, base)
        # No bot sidecar hashes as before bot envs travelled: an upgrade bumps no such row.
        self.assertEqual(base, settings.route_hash(row, env, {}))

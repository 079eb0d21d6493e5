"""``lchat hibernate --on/--off`` (lchat.handover.hibernate) on in-memory seams and a fake clock:
the admin API's real resource over a scripted activator, recording units and peers, and a real
FileStore as the hibernation bucket. The end-to-end promises (a real router, real spaces) are in
test_cli_hibernate and test_hibernate_off_newest."""

from __future__ import annotations

import os
from typing import Any

import attrs
from twisted.internet import task
from twisted.internet.defer import Deferred, succeed

from lchat import config, envfile, hosts
from lchat.handover import HandoverError
from lchat.handover.hibernate import Hibernation
from lchat.handover.router import Router, Say
from lchat.handover.start import Start, warn_if_born_dark
from lchat.hibernation.localdb import MARKER_SUFFIX, local_state, write_marker
from lchat.hibernation.space import WakeFailed
from lchat.objstore.file import FileStore
from lchat.registry import Route
from lchat.systemd_units import UnitError
from tests.fakes import inline
from tests.handover_fakes import (
    InMemoryAdmin,
    RecordingPeers,
    RecordingUnits,
    ScriptedActivator,
    clock_of,
    file_bucket,
)
from tests.test_cli import TOKEN, CliTestCase

HOST = "h.example.com"


class HandoverCase(CliTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.bucket_dir = os.path.join(self.root, "bucket")
        os.mkdir(self.bucket_dir)
        self.reactor = task.Clock()
        self.reactor.advance(1000)
        self.activator = ScriptedActivator(self.reactor)
        self.registry.migrate()
        self.admin = InMemoryAdmin(self.reactor, self.registry, self.activator)
        self.units = RecordingUnits(self.reactor, systemd=False)
        self.peers = RecordingPeers()
        self.listed: dict[str, str] = {}  # db -> the backup config that lists it
        self.lines: list[str] = []
        self.settings: dict[str, str] = {}
        self.configure()

    def configure(self, units: str = "builtin", **extra: str) -> None:
        self.settings = {
            "LCHAT_DATA_DIR": self.data_dir,
            "LCHAT_RUN_DIR": self.run_dir,
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.bucket_dir}",
            **extra,
        }
        self.write_router_env(units=units, **self.settings)
        self.units.systemd = units == "systemd"

    @property
    def cfg(self) -> config.BoxConfig:
        return config.load(env_file=self.env_file, flags={})

    @property
    def say(self) -> Say:
        return Say(
            out=self.lines.append,
            note=lambda m: self.lines.append(f"note: {m}"),
            warn=lambda m: self.lines.append(f"warning: {m}"),
        )

    def hibernation(self) -> Hibernation:
        return Hibernation(
            self.cfg,
            self.registry,
            self.admin,
            self.units,
            self.peers,
            file_bucket(self.reactor, self.bucket_dir),
            self.say,
            backed_up=self.listed.get,
            clock=clock_of(self.reactor),
        )

    def add_row(self, host: str = HOST, **row: Any) -> Route:
        envfile.write_token(hosts.env_path(self.data_dir, host), TOKEN)
        fields: dict[str, Any] = {
            "status": "ready",
            "socket": hosts.socket_path(self.run_dir, host),
            "db_path": hosts.db_path(self.data_dir, host),
            **row,
        }
        return self.registry.insert(Route(host=host, kind="instance", **fields))

    def on(self, timeout: float = 60.0) -> int:
        route = self.row(HOST)
        assert route is not None
        return self.hibernation().on(route, timeout)

    def off(self, timeout: float = 60.0) -> int:
        route = self.row(HOST)
        assert route is not None
        return self.hibernation().off(route, timeout)

    def refused(self, call: Any, *fragments: str) -> str:
        with self.assertRaises(HandoverError) as caught:
            call()
        for fragment in fragments:
            self.assertIn(fragment, str(caught.exception))
        return str(caught.exception)

    def assertInOrder(self, *fragments: str) -> None:
        text = "\n".join(self.lines)
        positions = []
        for fragment in fragments:
            self.assertIn(fragment, text)
            positions.append(text.index(fragment))
        self.assertEqual(positions, sorted(positions), text)

    def said(self, fragment: str) -> bool:
        return any(fragment in line for line in self.lines)

    # -- the bucket and the local copy ------------------------------------------------------

    def replica_up_to(self, txid: int) -> None:
        """The bucket holds a snapshot of the space up to ``txid`` (as another box wrote it)."""
        store = FileStore(self.reactor, self.bucket_dir, inline)
        key = self.cfg.hibernate.key(HOST, f"0009/{1:016x}-{txid:016x}.ltx")  # type: ignore[union-attr]
        self.successResultOf(Deferred.fromCoroutine(store.put(key, b"snapshot")))

    def local_copy(self, txid: int | None) -> str:
        """The local database, with a clean-sleep marker at ``txid`` (None: none)."""
        db = hosts.db_path(self.data_dir, HOST)
        with open(db, "wb") as f:
            f.write(b"db")
        if txid is not None:
            write_marker(db, txid, 0.0)
        return db


class OnTests(HandoverCase):
    def test_builtin_sets_the_flag_reloads_warms_and_then_tells_the_peers(self) -> None:
        self.add_row()
        db = self.local_copy(3)
        self.assertEqual(self.on(), 0)
        self.assertInOrder(
            f"{HOST}: {HOST}.env: already owned by",
            f"{HOST}: hibernate flag set",
            "the router stops running it as a builtin unit on reload",
            f"{HOST}: router reloaded",
            f"{HOST}: awake after the warm request (0.5s); hibernating",
        )
        route = self.row(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.status), (True, "ready"))
        self.assertFalse(os.path.exists(db + MARKER_SUFFIX))  # the unit wrote since: not vouched
        self.assertEqual(self.activator.calls, [("wake", HOST)])
        self.assertEqual(self.admin.calls[:2], ["POST /reload", "POST /wake"])
        self.assertEqual([(r.host, r.hibernate) for r in self.peers.pushed], [(HOST, True)])
        self.assertEqual(self.units.calls, [])

    def test_twice_says_so_and_warms_again(self) -> None:
        self.add_row(hibernate=True)
        self.assertEqual(self.on(), 0)
        self.assertTrue(self.said("already hibernating (flag on); checking the remaining steps"))
        self.assertFalse(self.said("hibernate flag set"))
        self.assertTrue(self.said("awake after the warm request"))

    def test_systemd_stops_the_sidecar_first_then_the_space(self) -> None:
        self.configure(units="systemd")
        self.add_row()
        envfile.write_token(hosts.bot_env_path(self.data_dir, HOST), TOKEN)
        self.assertEqual(self.on(), 0)
        self.assertEqual(self.units.calls, [f"stop lchat-bot@{HOST}", f"stop lchat@{HOST}"])
        self.assertInOrder(
            f"{HOST}: hibernate flag set",
            f"stopped and disabled lchat-bot@{HOST}",
            f"stopped and disabled lchat@{HOST}",
            f"{HOST}: router reloaded",
            f"{HOST}: awake after the warm request",
        )

    def test_a_unit_that_will_not_stop_leaves_it_flagged_with_what_to_do(self) -> None:
        self.configure(units="systemd")
        self.add_row()
        self.units.failing[f"lchat@{HOST}"] = UnitError("systemctl disable failed")
        self.refused(self.on, "systemctl disable failed", "is flagged hibernating", "--off")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual(self.activator.calls, [])

    def test_refused_while_the_backup_config_lists_it_flag_unchanged(self) -> None:
        self.add_row()
        self.listed[hosts.db_path(self.data_dir, HOST)] = "/etc/litestream.yml"
        self.refused(
            self.on,
            "still tracks",
            "(/etc/litestream.yml lists it)",
            f"regenerate the backup config without {HOST}",
            "then retry (the hibernate flag is unchanged)",
        )
        self.assertFalse(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual((self.admin.calls, self.units.calls), ([], []))

    def test_already_on_stays_on_when_refused(self) -> None:
        self.add_row(hibernate=True)
        self.listed[hosts.db_path(self.data_dir, HOST)] = "/etc/litestream.yml"
        self.refused(self.on, "still tracks", "(the hibernate flag is unchanged)")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_listed_after_the_flag_is_set_puts_the_flag_back(self) -> None:
        self.add_row(status="failed", last_error="boom")
        looks: list[str] = []

        def backed_up(db: str) -> str | None:
            looks.append(db)
            return "/etc/litestream.yml" if len(looks) == 2 else None

        hibernation = attrs.evolve(self.hibernation(), backed_up=backed_up)
        route = self.row(HOST)
        assert route is not None
        self.refused(lambda: hibernation.on(route, 60), "the hibernate flag is back as it was")
        self.assertTrue(self.said("hibernate flag set"))
        self.assertTrue(
            self.said("note: h.example.com: the hibernate flag was set and is off again")
        )
        after = self.row(HOST)
        assert after is not None
        self.assertEqual(
            (after.hibernate, after.status, after.last_error), (False, "failed", "boom")
        )

    def test_needs_a_bucket(self) -> None:
        self.configure(LCHAT_HIBERNATE_BUCKET="")
        self.add_row()
        self.refused(self.on, "needs a hibernation bucket: set LCHAT_HIBERNATE_BUCKET")
        self.assertFalse(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_without_a_router_it_wakes_on_its_first_request(self) -> None:
        self.add_row()
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertEqual(self.on(), 0)
        self.assertTrue(self.said("warning: the router is not running: h.example.com wakes on"))
        self.assertEqual((self.activator.calls, self.peers.pushed), ([], []))
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_a_router_that_cannot_be_reached_is_a_note_too(self) -> None:
        self.add_row()
        self.admin.down = PermissionError(13, "Permission denied")
        self.assertEqual(self.on(), 0)
        self.assertTrue(self.said("note: cannot reach the router"))

    def test_a_router_without_an_activator_is_a_warning(self) -> None:
        self.add_row()
        self.admin.api.activator = None
        self.assertEqual(self.on(), 0)
        self.assertTrue(self.said("the running router has no activator"))
        self.assertTrue(self.said("LCHAT_HIBERNATE_BUCKET is unset"))
        # Not awake here: the peers keep forwarding to this box, and are told how to catch up.
        self.assertEqual(self.peers.pushed, [])
        self.assertTrue(self.said("mesh: h.example.com is not awake here yet"))

    def test_a_router_that_has_not_seen_the_flag_yet_is_a_warning(self) -> None:
        self.add_row()
        table = self.admin.routes.table
        self.patch(self.admin.routes, "reload", lambda reason: succeed(table))
        self.assertEqual(self.on(), 0)
        self.assertTrue(self.said("does not see h.example.com as hibernating yet"))

    def test_a_warm_request_that_fails_fails_the_command_flag_stays(self) -> None:
        self.add_row()
        self.activator.wakes = [WakeFailed(HOST, "spawn", "the space did not start")]
        self.refused(self.on, f"{HOST}: the warm request failed: the space did not start")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_a_warm_request_never_answered_is_a_timeout(self) -> None:
        self.add_row()
        self.activator.wakes = [None]
        self.refused(lambda: self.on(timeout=7), "no answer to the warm request within 7s")

    def test_waits_for_the_old_process_to_let_go_of_the_socket(self) -> None:
        self.add_row()
        socket = hosts.socket_path(self.run_dir, HOST)
        self.units.held[socket] = self.reactor.seconds() + 2.0
        self.assertEqual(self.on(), 0)
        self.assertGreaterEqual(self.reactor.seconds(), 1002.0)
        self.assertFalse(self.said("still listens"))
        self.units.held[socket] = float("inf")  # a squatter: warned about once the wait is up
        self.activator.states.clear()
        self.assertEqual(self.on(timeout=3), 0)
        self.assertTrue(self.said(f"still listens on {socket} after 3s: the wake may fail"))


class OffTests(HandoverCase):
    def test_builtin_tells_the_peers_sleeps_clears_the_flag_and_health_checks(self) -> None:
        self.add_row(hibernate=True, next_due=2_000_000_000)
        self.admin.routes.reload("test")
        self.activator.states[HOST] = "awake"
        self.assertEqual(self.off(), 0)
        self.assertInOrder(
            f"{HOST}: asleep (flushed to the bucket, lease released)",
            f"{HOST}: hibernate flag cleared",
            f"{HOST}: router reloaded",
            f"{HOST} is ready",
        )
        # The peers first, in the lives-elsewhere shape.
        self.assertEqual([(r.hibernate, r.next_due) for r in self.peers.pushed], [(False, 0)])
        route = self.row(HOST)
        assert route is not None
        self.assertEqual((route.hibernate, route.next_due), (False, 0))
        self.assertEqual(self.units.calls, [f"health {HOST}"])

    def test_flag_already_off_runs_the_remaining_steps(self) -> None:
        self.add_row()
        self.assertEqual(self.off(), 0)
        self.assertTrue(self.said("not hibernating (flag already off); checking the remaining"))
        self.assertEqual(self.activator.calls, [])

    def test_systemd_starts_the_unit_checks_it_then_starts_the_sidecar(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True, status="failed", last_error="old")
        envfile.write_token(hosts.bot_env_path(self.data_dir, HOST), TOKEN)
        self.assertEqual(self.off(), 0)
        self.assertEqual(
            self.units.calls,
            [f"start lchat@{HOST}", f"health {HOST}", f"start lchat-bot@{HOST}"],
        )
        self.assertInOrder(
            f"{HOST}: hibernate flag cleared",
            f"{HOST}: router reloaded",
            f"enabled and started lchat@{HOST}",
            f"{HOST} is ready",
            f"enabled and started lchat-bot@{HOST}",
        )
        route = self.row(HOST)
        assert route is not None
        self.assertEqual((route.status, route.last_error), ("ready", ""))  # recorded

    def test_systemd_without_a_router_starts_the_unit(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True)
        self.admin.down = ConnectionRefusedError(111, "Connection refused")
        self.assertEqual(self.off(), 0)
        self.assertEqual(self.units.calls, [f"start lchat@{HOST}", f"health {HOST}"])
        self.assertFalse(self.said("router reloaded"))

    def test_builtin_without_a_router_leaves_the_start_to_it(self) -> None:
        self.add_row(hibernate=True)
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertEqual(self.off(), 0)
        self.assertTrue(self.said("the router is not running: it starts h.example.com when"))
        self.assertFalse(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_systemd_refuses_a_socket_its_unit_would_not_use(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True, socket="/srv/elsewhere.sock")
        self.refused(self.off, "its socket /srv/elsewhere.sock is not", "LCHAT_UNITS=builtin can")
        self.assertEqual((self.peers.pushed, self.units.calls), ([], []))

    def test_refuses_while_something_holds_the_socket(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True)
        self.units.held[hosts.socket_path(self.run_dir, HOST)] = float("inf")
        self.refused(lambda: self.off(0.5), "still listens on", "would refuse to start over it")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual(self.units.calls, [])

    def test_a_unit_that_fails_to_start_is_recorded_failed(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True)
        self.units.failing[f"lchat@{HOST}"] = UnitError("systemctl enable failed")
        self.refused(self.off, f"{HOST} failed: systemctl enable failed")
        route = self.row(HOST)
        assert route is not None
        self.assertEqual((route.status, route.last_error), ("failed", "systemctl enable failed"))

    def test_a_health_check_that_fails_is_recorded_under_systemd(self) -> None:
        self.configure(units="systemd")
        self.add_row(hibernate=True)
        self.units.healthy = False
        socket = hosts.socket_path(self.run_dir, HOST)
        self.refused(lambda: self.off(5), f"{HOST} failed: not answering on {socket} after 5s")
        self.assertEqual(self.row(HOST).status, "failed")  # type: ignore[union-attr]

    def test_a_health_check_that_fails_says_the_routers_verdict_under_builtin(self) -> None:
        self.add_row(hibernate=True)
        self.units.healthy = False
        self.registry.set_status(HOST, "failed", "the space  exited\n(code 3)")
        self.refused(lambda: self.off(5), f"{HOST} failed: the space exited (code 3)")

    def test_a_sleep_that_takes_too_long_changes_nothing(self) -> None:
        self.add_row(hibernate=True)
        self.admin.routes.reload("test")
        self.activator.sleep_hangs = True
        self.refused(self.off, "did not finish putting it to sleep within 150s", "retry")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]


class NewestCopyTests(HandoverCase):
    """``--off`` hands the unit the newest copy: a bucket ahead of the local file is fetched by
    one wake and one sleep under the lease, or the command refuses and nothing is handed over."""

    def setUp(self) -> None:
        super().setUp()
        self.add_row(hibernate=True)
        self.admin.routes.reload("test")

    def restores_to(self, txid: int) -> None:
        """The activator's wake restores the bucket's copy; its sleep writes the marker."""
        self.activator.after_sleep = lambda host: write_marker(self.local_copy(None), txid, 0.0)

    def test_a_current_local_copy_is_handed_over_without_a_wake(self) -> None:
        self.replica_up_to(5)
        db = self.local_copy(5)
        self.assertEqual(self.off(), 0)
        self.assertTrue(self.said(f"{HOST}: {db} is the newest copy (txid 5)"))
        self.assertEqual(self.activator.calls, [("sleep", HOST)])

    def test_a_never_woken_space_needs_nothing(self) -> None:
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertEqual(self.off(), 0)
        self.assertTrue(self.said(f"{HOST}: hibernate flag cleared"))

    def test_a_newer_copy_in_the_bucket_is_fetched_before_the_unit_starts(self) -> None:
        self.replica_up_to(9)
        db = self.local_copy(3)
        self.restores_to(9)
        self.assertEqual(self.off(), 0)
        self.assertInOrder(
            f"{HOST}: asleep",
            f"{db} is txid 3; the bucket has txid 9: fetching the newest copy from the bucket",
            f"{HOST}: woken here from the newest copy (0.5s)",
            f"{HOST}: {db} is now the newest copy (txid 9)",
            f"{HOST}: hibernate flag cleared",
            f"{HOST} is ready",
        )
        self.assertEqual(self.activator.calls, [("sleep", HOST), ("wake", HOST), ("sleep", HOST)])
        self.assertFalse(os.path.exists(db + MARKER_SUFFIX))

    def test_still_stale_after_the_wake_it_stays_hibernating(self) -> None:
        self.replica_up_to(9)
        self.local_copy(3)
        self.refused(self.off, "after the wake and sleep here", "it stays hibernating")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual(self.units.calls, [])

    def test_a_newer_copy_and_no_router_refuses_before_anything_changes(self) -> None:
        self.replica_up_to(9)
        db = self.local_copy(3)
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.refused(
            self.off,
            "the newest copy is in the bucket",
            "no router answers",
            f"start the router, then re-run `lchat hibernate {HOST} --off`",
            "the bucket has txid 9",
        )
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual(self.peers.pushed, [])  # the peers were not told
        self.assertEqual(local_state(db).marker_txid, 3)  # the old file and its marker kept

    def test_a_lease_a_peer_still_releases_is_waited_out(self) -> None:
        self.replica_up_to(9)
        self.local_copy(3)
        self.restores_to(9)
        held = WakeFailed(HOST, "lease_held", "the lease is held by box-b", 1.0)
        self.activator.wakes = [held, held, 0.5]
        self.assertEqual(self.off(), 0)
        self.assertEqual([c for c in self.activator.calls if c[0] == "wake"], [("wake", HOST)] * 3)

    def test_a_lease_held_past_the_timeout_is_a_refusal(self) -> None:
        self.replica_up_to(9)
        self.local_copy(3)
        held = WakeFailed(HOST, "lease_held", "the lease is held by box-b", 1.0)
        self.activator.wakes = [held] * 100
        self.refused(
            lambda: self.off(3),
            "the wake that fetches its newest copy failed: the lease is held by box-b",
            f"`lchat hibernate {HOST} --on` to give the peers its hibernating row back",
        )
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]

    def test_a_router_without_an_activator_cannot_fetch_it(self) -> None:
        self.replica_up_to(9)
        self.local_copy(3)
        self.admin.api.activator = None
        self.refused(self.off, "has no activator", "so it cannot fetch the newest copy")

    def test_awake_here_again_is_the_newest_copy(self) -> None:
        self.replica_up_to(9)
        self.local_copy(3)
        self.activator.states[HOST] = "awake"

        def woken_again(host: str) -> None:  # a request wakes it here again after the sleep
            self.activator.states[host] = "awake"

        self.activator.after_sleep = woken_again
        self.assertEqual(self.off(), 0)
        self.assertTrue(self.said(f"{HOST}: awake here again (a request woke it under its lease"))
        self.assertNotIn(("wake", HOST), self.activator.calls)

    def test_a_space_homed_where_another_bucket_keeps_it_is_refused(self) -> None:
        fi = os.path.join(self.root, "fi")
        self.configure(LCHAT_REGION_BUCKETS=f"fi=file:{fi}")
        self.registry.update(HOST, home_region="fi")
        self.refused(
            self.off,
            f"{HOST} is homed in region fi, whose replicas live in file:{fi}",
            f"`lchat relocate {HOST} --to <this box's region>`",
            "nothing changed",
        )
        self.assertEqual((self.peers.pushed, self.admin.calls), ([], []))

    def test_a_bucket_that_cannot_be_read_is_refused(self) -> None:
        os.rmdir(self.bucket_dir)
        self.refused(self.off, "cannot read the bucket to check that", "does not exist")
        self.assertTrue(self.row(HOST).hibernate)  # type: ignore[union-attr]
        self.assertEqual(self.peers.pushed, [])


class StartTests(HandoverCase):
    """add-instance's start of an always-on space."""

    def start(self, *, wait: bool = True, timeout: float = 30.0) -> int:
        router = Router(self.admin, self.say)
        start = Start(self.cfg, self.registry, router, self.units, clock_of(self.reactor))
        return start(HOST, hosts.socket_path(self.run_dir, HOST), timeout, wait=wait)

    def test_systemd_health_checks_and_routes_it(self) -> None:
        self.configure(units="systemd")
        self.add_row(status="creating")
        self.assertEqual(self.start(), 0)
        self.assertEqual(self.units.calls, [f"start lchat@{HOST}", f"health {HOST}"])
        self.assertEqual(self.row(HOST).status, "ready")  # type: ignore[union-attr]

    def test_systemd_no_wait_routes_it_unchecked(self) -> None:
        self.configure(units="systemd")
        self.add_row(status="creating")
        self.assertEqual(self.start(wait=False), 0)
        self.assertTrue(self.said("routed without a health check (--no-wait)"))
        self.assertEqual(self.row(HOST).status, "ready")  # type: ignore[union-attr]

    def test_systemd_not_answering_is_recorded_failed(self) -> None:
        self.configure(units="systemd")
        self.add_row(status="creating")
        self.units.healthy = False
        self.refused(lambda: self.start(timeout=4), "not answering on", "after 4s")
        self.assertEqual(self.row(HOST).status, "failed")  # type: ignore[union-attr]

    def test_builtin_waits_for_the_supervisors_verdict(self) -> None:
        self.add_row(status="creating")
        self.reactor.callLater(3, self.registry.set_status, HOST, "ready")
        self.assertEqual(self.start(), 0)
        self.assertTrue(self.said(f"{HOST} is ready"))
        self.registry.set_status(HOST, "creating")
        self.reactor.callLater(1, self.registry.set_status, HOST, "failed", "exit 3")
        self.refused(self.start, f"{HOST} failed: exit 3")
        self.registry.set_status(HOST, "creating")
        self.refused(lambda: self.start(timeout=2), f"{HOST} is still creating after 2s")

    def test_builtin_without_a_router_starts_when_it_does(self) -> None:
        self.add_row(status="creating")
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertEqual(self.start(), 0)
        self.assertTrue(self.said("warning: router is not running"))

    def test_a_create_without_the_mesh_on_a_mesh_router_warns(self) -> None:
        member = InMemoryAdmin(
            self.reactor, self.registry, None, mesh=lambda: {"env_file": "/data/router.env"}
        )
        warn_if_born_dark(self.cfg, member, HOST, self.say)
        self.assertTrue(self.said("is a mesh member, but"))
        self.assertTrue(self.said("`lchat mesh-seed <peer URL> --env-file /data/router.env`"))
        self.lines.clear()
        warn_if_born_dark(self.cfg, self.admin, HOST, self.say)  # not a mesh member
        self.assertEqual(self.lines, [])

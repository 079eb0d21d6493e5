"""``lchat deploy`` and ``lchat rollback`` (lchat.release.deploy.Deployer) on in-memory seams and
a fake clock: builtin units through the admin API's real resource (``POST /restart``, ``GET
/status``), systemd units recorded, the health gate scripted. Builds and links are real files.
The end-to-end promises (a real router running real builds) are in test_deploy."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from lchat import builds, hosts
from lchat.builds import BuildLayout, BuildRecord
from lchat.registry import Registry, Route
from lchat.release import deploy
from lchat.release.deploy import Deployer, DeployError, RouterRestarter, SystemdRestarter
from lchat.supervise import ChildStatus
from lchat.systemd_units import UnitError
from tests.handover_fakes import InMemoryAdmin, RecordingUnits

A, B = "a.example.com", "b.example.com"


class DeployCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.layout = BuildLayout(os.path.join(self.root, "opt"))
        self.data_dir = os.path.join(self.root, "data")
        os.mkdir(self.data_dir)
        self.reactor = task.Clock()
        self.reactor.advance(1_700_000_000)
        self.registry = Registry(
            os.path.join(self.data_dir, "registry.db"), clock=self.reactor.seconds
        )
        self.registry.migrate()
        self.units = RecordingUnits(self.reactor)
        self.broken: set[str] = set()  # versions whose space never answers
        self.processes: dict[str, ChildStatus] = {}  # the supervisor's view (GET /status)
        self.restarts: list[str] = []
        self.admin = InMemoryAdmin(
            self.reactor, self.registry, None, children=lambda: self.processes, restart=self.restart
        )
        self.lines: list[str] = []
        self.hibernating: set[str] = set()
        self.awake: set[str] = set()

    def restart(self, host: str) -> Deferred[int | None]:
        """The router's supervisor: a new run of the host's live build, pid 100, 101, ..."""
        if host not in self.routes():
            raise KeyError(host)
        self.restarts.append(host)
        pid = 100 + len(self.restarts)
        if self.layout.version_of(host) in self.broken:
            self.processes[host] = ChildStatus("backoff", None, 1, "exit 3:\n bad", 0.0)
        else:
            self.processes[host] = ChildStatus("ready", pid, 0, None, 0.0)
        return succeed(pid)

    def answers(self, socket: str, host: str, timeout: float) -> bool:
        if self.layout.version_of(host) in self.broken:
            self.reactor.advance(timeout)
            return False
        return True

    def install(self, *versions: str, sidecar: bool = False) -> None:
        for version in versions:
            os.makedirs(self.layout.build_dir(version), exist_ok=True)
            for bot in (False, True) if sidecar else (False,):
                path = self.layout.binary(version, sidecar=bot)
                with open(path, "w") as f:
                    f.write("#!/bin/sh\n")
                os.chmod(path, 0o755)

    def add(self, host: str, version: str | None, *, hibernate: bool = False) -> None:
        if version is not None:
            deploy.point(self.layout, host, version)
        self.registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=f"/run/{host}.sock",
                db_path=hosts.db_path(self.data_dir, host),
                status="ready",
                hibernate=hibernate,
            )
        )
        self.admin.routes.reload("test")

    def routes(self) -> dict[str, Route]:
        return {r.host: r for r in self.registry.load()}

    def deployer(
        self,
        restarter: Any = None,
        timeout: float = 30.0,
        floor: Callable[[str], BuildRecord | None] | None = None,
    ) -> Deployer:
        return Deployer(
            layout=self.layout,
            data_dir=self.data_dir,
            routes=self.routes(),
            restarter=restarter or RouterRestarter(self.admin),
            out=self.lines.append,
            timeout=timeout,
            awake=lambda host: host in self.awake,
            answers=self.answers,
            floor=floor,
            clock=self.reactor.seconds,
            monotonic=self.reactor.seconds,
        )

    def said(self, fragment: str) -> bool:
        return any(fragment in line for line in self.lines)


class AlwaysOnTests(DeployCase):
    def test_canary_then_all_then_rollback(self) -> None:
        self.install("v1", "v2")
        self.add(A, "v1")
        self.add(B, "v1")
        self.assertEqual(self.deployer().deploy("v2", [A], canary=True, batch=1), 0)
        self.assertEqual(self.lines, [f"{A}: v1 -> v2: restarted, healthy"])
        self.assertEqual((self.layout.version_of(A), self.layout.version_of(B)), ("v2", "v1"))
        states = deploy.read_states(self.layout)
        self.assertEqual(
            (states[A].version, states[A].previous, states[A].canary), ("v2", "v1", True)
        )

        self.assertEqual(self.deployer().deploy("v2", [A, B], canary=False, batch=5), 0)
        self.assertTrue(self.said(f"{A}: already on v2"))
        self.assertTrue(self.said(f"{B}: v1 -> v2: restarted, healthy"))
        states = deploy.read_states(self.layout)
        self.assertEqual((states[A].canary, states[A].previous), (False, "v1"))  # settled
        self.assertEqual(self.restarts, [A, B])

        self.lines.clear()
        self.assertEqual(self.deployer().rollback([A]), 0)
        self.assertEqual(self.lines, [f"{A}: v2 -> v1: restarted, healthy"])
        self.assertEqual(self.layout.version_of(A), "v1")
        self.assertEqual(self.deployer().rollback([A]), 1)
        self.assertTrue(self.said("refused: no previous version recorded (no deploy to roll back)"))

    def test_a_build_whose_run_exits_is_rolled_back_and_the_rollout_stops(self) -> None:
        self.install("v1", "bad")
        self.broken.add("bad")
        self.add(A, "v1")
        self.add(B, "v1")
        before = self.reactor.seconds()
        self.assertEqual(self.deployer(timeout=20).deploy("bad", [A, B], canary=False, batch=1), 1)
        self.assertTrue(
            self.said(f"{A}: v1 -> bad FAILED (it exited: exit 3: bad); rolled back to v1, healthy")
        )
        self.assertTrue(
            self.said(f"rollout stopped: 1 of 1 in this batch failed; 1 host(s) not touched: {B}")
        )
        self.assertLess(
            self.reactor.seconds() - before, 20
        )  # the router's verdict, not the timeout
        self.assertEqual((self.layout.version_of(A), self.layout.version_of(B)), ("v1", "v1"))
        self.assertEqual(self.restarts, [A, A])
        self.assertNotIn(A, deploy.read_states(self.layout))  # a failed deploy records nothing

    def test_a_build_that_never_answers_fails_at_the_timeout(self) -> None:
        self.install("v1", "mute")
        self.broken.add("mute")
        self.add(A, "v1")
        self.restart = lambda host: succeed(7)  # type: ignore[method-assign]
        self.admin.api.restart = self.restart
        self.assertEqual(self.deployer(timeout=3).deploy("mute", [A], canary=True, batch=1), 1)
        self.assertTrue(
            self.said(f"{A}: v1 -> mute FAILED (not answering on /run/{A}.sock after 3s)")
        )

    def test_a_rollback_onto_a_build_that_fails_too_says_so(self) -> None:
        self.install("v1", "v2")
        self.add(A, "v1")
        self.assertEqual(self.deployer().deploy("v2", [A], canary=False, batch=1), 0)
        self.broken.update({"v1", "v2"})
        self.assertEqual(self.deployer(timeout=2).rollback([A]), 1)
        self.assertTrue(
            self.said(
                f"{A}: rollback to v1 FAILED (it exited: exit 3: bad); back on v2, which does not answer either"
            )
        )
        self.assertEqual(self.layout.version_of(A), "v2")

    def test_a_space_that_was_failing_is_fixed_by_a_deploy(self) -> None:
        """The supervisor's "failed" from before the restart is not the new run's verdict."""
        self.install("bad", "v1")
        self.add(A, "bad")
        self.admin.api.restart = lambda host: succeed(42)
        # Still "failed" from before, but with the pid the restart started: not its verdict.
        self.processes[A] = ChildStatus("failed", 42, 5, "old", 0.0)
        self.assertEqual(self.deployer().deploy("v1", [A], canary=True, batch=1), 0)
        self.assertTrue(self.said(f"{A}: bad -> v1: restarted, healthy"))

    def test_a_router_that_refuses_the_restart_is_a_failure(self) -> None:
        self.install("v1", "v2")
        self.add(A, "v1")
        self.admin.api.restart = None  # no builtin units here: 409
        self.assertEqual(self.deployer().deploy("v2", [A], canary=True, batch=1), 1)
        self.assertTrue(
            self.said(f"{A}: v1 -> v2 FAILED ({A}: the router answered 409 to the restart")
        )
        self.admin.down = FileNotFoundError(2, "No such file or directory")
        self.assertFalse(RouterRestarter(self.admin).reachable())
        self.lines.clear()
        self.assertEqual(self.deployer().deploy("v2", [A], canary=True, batch=1), 1)
        self.assertTrue(self.said("could not ask the router to restart it"))

    def test_refusals_change_nothing(self) -> None:
        self.install("v1")
        self.add(A, "v1")
        with self.assertRaises(DeployError) as missing:
            self.deployer().deploy("v9", [A], canary=True, batch=1)
        self.assertIn("version v9 is not installed", str(missing.exception))
        with self.assertRaises(DeployError) as unknown:
            self.deployer().deploy("v1", ["nope.example.com"], canary=True, batch=1)
        self.assertIn("is not a space registered on this box", str(unknown.exception))
        with deploy.deploy_lock(self.layout), self.assertRaises(DeployError) as locked:
            self.deployer().rollback([A])
        self.assertIn(
            "another `lchat deploy` or `lchat rollback` is running", str(locked.exception)
        )
        self.assertEqual(self.restarts, [])

    def test_default_build_and_sidecar_links(self) -> None:
        self.install("v1", sidecar=True)
        self.install("v2")
        deployer = self.deployer()
        deployer.set_default("v1")
        self.assertEqual(self.lines[-1][:29], "default build: - -> v1 (what ")
        self.assertEqual(self.layout.version_of("later.example.com"), "v1")
        deployer.set_default("v1")
        self.assertEqual(self.lines[-1], "default build: already v1")
        self.install("v0")
        self.add(A, "v0")
        self.assertEqual(self.deployer().deploy("v1", [A], canary=False, batch=1), 0)
        self.assertTrue(os.path.lexists(self.layout.live_link(A, sidecar=True)))
        self.assertEqual(self.deployer().deploy("v2", [A], canary=False, batch=1), 0)
        self.assertFalse(os.path.lexists(self.layout.live_link(A, sidecar=True)))  # none in v2


class SystemdTests(DeployCase):
    def test_restarts_the_unit_and_restores_it_when_the_build_fails(self) -> None:
        self.install("v1", "v2", "bad")
        self.broken.add("bad")
        self.add(A, "v1")
        restarter = SystemdRestarter(self.units.restart)
        self.assertEqual(self.deployer(restarter).deploy("v2", [A], canary=True, batch=1), 0)
        self.assertEqual(
            self.deployer(restarter, timeout=3).deploy("bad", [A], canary=True, batch=1), 1
        )
        self.assertTrue(
            self.said(
                f"{A}: v2 -> bad FAILED (not answering on /run/{A}.sock after 3s); rolled back to v2, healthy"
            )
        )
        self.assertEqual(self.units.calls, [f"restart lchat@{A}"] * 3)

    def test_a_unit_that_will_not_restart_is_a_failure(self) -> None:
        self.install("v1", "v2")
        self.add(A, "v1")
        self.units.failing[f"lchat@{A}"] = UnitError("systemctl restart failed")
        restarter = SystemdRestarter(self.units.restart)
        self.assertEqual(self.deployer(restarter).deploy("v2", [A], canary=True, batch=1), 1)
        self.assertTrue(self.said(f"FAILED ({A}: systemctl restart failed)"))


class HibernatingTests(DeployCase):
    def test_repointed_and_then_refused_a_rollback_past_a_wake(self) -> None:
        self.install("v1", "v2")
        self.add(A, "v1", hibernate=True)
        self.add(B, "v1", hibernate=True)
        self.awake.add(A)
        self.assertEqual(self.deployer().deploy("v2", [A, B], canary=False, batch=5), 0)
        self.assertTrue(
            self.said(
                f"{A}: v1 -> v2: repointed (hibernating: its next wake runs v2); awake now, it runs v1 until it sleeps"
            )
        )
        self.assertTrue(self.said(f"{B}: v1 -> v2: repointed (hibernating: its next wake runs v2)"))
        self.assertEqual(self.restarts, [])  # a hibernating space is never restarted
        builds.record(self.data_dir, A, self.layout.live_link(A), self.reactor.seconds)
        self.lines.clear()
        self.assertEqual(self.deployer().rollback([A, B]), 1)
        self.assertTrue(self.said(f"{A}: refused: it woke on v2 at"))
        self.assertTrue(self.said(f"{B}: v2 -> v1: repointed (hibernating)"))
        self.assertEqual((self.layout.version_of(A), self.layout.version_of(B)), ("v2", "v1"))

    def test_the_build_floor_in_the_bucket_refuses_what_this_box_never_saw(self) -> None:
        """A wake on another box is on record in the bucket only (its floor): a rollback below
        it is refused, one to the floor's own build or above it is allowed, and an unreadable
        bucket refuses rather than guess. Read before the repoint and again after."""
        self.install("v1", "v2")
        for host in (A, B):
            self.add(host, "v1", hibernate=True)
        self.assertEqual(self.deployer().deploy("v2", [A, B], canary=False, batch=5), 0)
        self.lines.clear()
        floors = {
            A: BuildRecord("v3", self.reactor.seconds(), "https://box-b.example.net"),
            B: BuildRecord("v1", self.reactor.seconds(), "https://box-b.example.net"),
        }
        self.assertEqual(self.deployer(floor=floors.get).rollback([A, B]), 1)
        self.assertTrue(self.said(f"{A}: refused: it ran v3 on https://box-b.example.net (first"))
        self.assertTrue(self.said("which v1 does not know"))
        self.assertTrue(self.said(f"{B}: v2 -> v1: repointed (hibernating)"))
        self.assertEqual((self.layout.version_of(A), self.layout.version_of(B)), ("v2", "v1"))

        def unreadable(host: str) -> BuildRecord | None:
            raise DeployError("its build floor in the bucket could not be read (down)")

        self.lines.clear()
        self.assertEqual(self.deployer(floor=unreadable).rollback([A]), 1)
        self.assertTrue(self.said(f"{A}: refused: its build floor in the bucket could not be read"))
        self.assertEqual(self.layout.version_of(A), "v2")

        # A wake elsewhere lands between the check and the repoint: the link goes forward again.
        reads: list[str] = []

        def racing(host: str) -> BuildRecord | None:
            reads.append(host)
            return None if len(reads) == 1 else BuildRecord("v2", 0.0, "https://box-b.example.net")

        self.lines.clear()
        self.assertEqual(self.deployer(floor=racing).rollback([A]), 1)
        self.assertEqual(reads, [A, A])
        self.assertTrue(self.said(f"{A}: refused: it ran v2 on https://box-b.example.net"))
        self.assertEqual(self.layout.version_of(A), "v2")

    def test_a_rollback_after_a_hand_change_is_refused(self) -> None:
        self.install("v1", "v2", "v3")
        self.add(A, "v1", hibernate=True)
        self.assertEqual(self.deployer().deploy("v2", [A], canary=False, batch=1), 0)
        deploy.point(self.layout, A, "v3")
        self.assertEqual(self.deployer().rollback([A]), 1)
        self.assertTrue(self.said(f"{A}: refused: it is on v3, not v2 as the last deploy left it"))

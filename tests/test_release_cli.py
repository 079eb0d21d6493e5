"""``lchat release keygen|publish|fetch|list`` as an operator runs them: real processes, a feed
directory served over HTTP on 127.0.0.1, an S3 mirror on moto's server."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from lchat.builds import BuildLayout
from lchat.cli import runner
from lchat.objstore.file import FileStore
from lchat.registry import Registry, Route
from lchat.release import feed as feedlib
from lchat.release.publish import DirectoryTarget, publish
from tests.fakes import inline
from tests.s3servers import shared_server
from tests.test_mesh import DOMAIN, TOKEN
from tests.test_release_feed import closed_port_url, serve_directory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lchat(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LCHAT_", "AWS_"))}
    env["PYTHONPATH"] = ROOT
    return subprocess.run(
        [sys.executable, "-m", "lchat.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


class ReleaseCliTests(TestCase):
    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]  # trial waits for it
        self.tmp = tempfile.mkdtemp(prefix="rc")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.www = os.path.join(self.tmp, "www")
        os.makedirs(os.path.join(self.www, "feed"))
        server, self.url = serve_directory(self.www)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        s3 = await shared_server("moto")
        self.bucket = await s3.new_bucket()
        self.mirror = f"s3://{self.bucket}/rel?region={s3.region}&endpoint={s3.endpoint}"
        self.aws = {
            "AWS_ACCESS_KEY_ID": s3.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.credentials.secret_key,
        }
        self.opt = os.path.join(self.tmp, "opt")
        self.data = os.path.join(self.tmp, "data")
        os.makedirs(self.data)
        self.key = os.path.join(self.tmp, "release.key")

    def env_file(self, name: str, **values: str) -> str:
        path = os.path.join(self.tmp, name)
        settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.tmp,
            "LCHAT_OPT_DIR": self.opt,
            **self.aws,
            **values,
        }
        with open(path, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in settings.items()))
        return path

    def build(self, version: str) -> str:
        directory = os.path.join(self.tmp, "builds", version)
        os.makedirs(directory)
        with open(os.path.join(directory, "space"), "w") as f:
            f.write(f"#!/bin/sh\necho {version}\n")
        os.chmod(os.path.join(directory, "space"), 0o755)
        return directory

    def keygen(self) -> str:
        made = lchat("release", "keygen", "--out", self.key)
        self.assertEqual(made.returncode, 0, made)
        self.assertEqual(stat.S_IMODE(os.stat(self.key).st_mode), 0o600)
        lines = [ln for ln in made.stdout.splitlines() if ln.startswith("LCHAT_RELEASE_PUBKEY=")]
        self.assertEqual(len(lines), 1, made.stdout)
        return lines[0].split("=", 1)[1]

    def test_keygen_publish_fetch_list(self) -> None:
        pubkey = self.keygen()
        again = lchat("release", "keygen", "--out", self.key)
        self.assertEqual(again.returncode, 1, again)
        self.assertIn("exists: refusing to overwrite a key", again.stderr)

        publisher = self.env_file("publisher.env", LCHAT_RELEASE_MIRROR_URL=self.mirror)
        feed_dir = os.path.join(self.www, "feed")
        for version in ("1.0.0", "1.1.0"):
            published = lchat(
                "release", "publish", version, self.build(version), "--key", self.key,
                "--to", feed_dir, "--mirror", "--env-file", publisher,
            )  # fmt: skip
            self.assertEqual(published.returncode, 0, published)
        self.assertIn("published 1.1.0 as feed_version 2", published.stdout)
        with open(os.path.join(feed_dir, "feed.json")) as f:
            self.assertEqual(sorted(json.load(f)["versions"]), ["1.0.0", "1.1.0"])

        box = self.env_file(
            "router.env",
            LCHAT_RELEASE_URL=self.url,
            LCHAT_RELEASE_MIRROR_URL=self.mirror,
            LCHAT_RELEASE_PUBKEY=pubkey,
        )
        fetched = lchat("release", "fetch", "1.1.0", "--env-file", box)
        self.assertEqual(fetched.returncode, 0, fetched)
        self.assertIn("1.1.0: installed in", fetched.stdout)
        self.assertIn("(feed from the primary)", fetched.stdout)
        self.assertEqual(BuildLayout(self.opt).installed(), ["1.1.0"])

        # The primary down: the mirror serves the same signed feed.
        os.rename(feed_dir, feed_dir + ".gone")
        fetched = lchat("release", "fetch", "1.0.0", "--env-file", box)
        self.assertEqual(fetched.returncode, 0, fetched)
        self.assertIn("(feed from the mirror)", fetched.stdout)

        registry = Registry(os.path.join(self.data, "registry.db"), clock=lambda: 0.0)
        registry.migrate()
        registry.insert(Route("a.example.com", kind="instance", socket="/run/a.sock"))
        os.makedirs(os.path.join(self.opt, "live"))
        os.symlink("../versions/1.1.0/space", os.path.join(self.opt, "live", "a.example.com"))
        listed = lchat("release", "list", "--env-file", box)
        self.assertEqual(listed.returncode, 0, listed)
        rows = [ln.split() for ln in listed.stdout.splitlines()]
        self.assertEqual(rows[0], ["VERSION", "INSTALLED", "HOSTS", "IN-FEED", "RELEASED"])
        self.assertEqual(
            [r[:4] for r in rows[1:3]], [["1.0.0", "yes", "0", "yes"], ["1.1.0", "yes", "1", "yes"]]
        )
        self.assertIn("feed: feed_version 2 from the mirror", listed.stdout)

    def test_publish_signs_an_expiry_and_refresh_extends_it(self) -> None:
        pubkey = self.keygen()
        feed_dir = os.path.join(self.www, "feed")
        publisher = self.env_file("publisher.env", LCHAT_RELEASE_FEED_VALIDITY="2h")
        started = time.time()
        published = lchat(
            "release", "publish", "1.0.0", self.build("1.0.0"), "--key", self.key,
            "--to", feed_dir, "--env-file", publisher,
        )  # fmt: skip
        self.assertEqual(published.returncode, 0, published)
        with open(os.path.join(feed_dir, "feed.json")) as f:
            first = json.load(f)
        expires = feedlib.parse_stamp(first["expires_at"])
        self.assertLess(abs(expires - (started + 7200)), 120)
        self.assertIn(f"expires {first['expires_at']}", published.stdout)

        longer = self.env_file("longer.env", LCHAT_RELEASE_FEED_VALIDITY="30d")
        refreshed = lchat(
            "release", "refresh", "--key", self.key, "--to", feed_dir, "--env-file", longer
        )
        self.assertEqual(refreshed.returncode, 0, refreshed)
        self.assertIn("refreshed the feed as feed_version 2", refreshed.stdout)
        with open(os.path.join(feed_dir, "feed.json")) as f:
            second = json.load(f)
        self.assertEqual((second["feed_version"], sorted(second["versions"])), (2, ["1.0.0"]))
        self.assertGreater(feedlib.parse_stamp(second["expires_at"]), started + 29 * 86400)

        box = self.env_file("router.env", LCHAT_RELEASE_URL=self.url, LCHAT_RELEASE_PUBKEY=pubkey)
        listed = lchat("release", "list", "--env-file", box)
        self.assertEqual(listed.returncode, 0, listed)
        self.assertIn(f"expires {second['expires_at']}", listed.stdout)

        bad = self.env_file("bad.env", LCHAT_RELEASE_FEED_VALIDITY="5m")
        refused = lchat(
            "release", "refresh", "--key", self.key, "--to", feed_dir, "--env-file", bad
        )
        self.assertEqual(refused.returncode, 1, refused)
        self.assertIn("LCHAT_RELEASE_FEED_VALIDITY=5m must be between 1h and 365d", refused.stderr)

    def test_refusals_are_one_line_and_change_nothing(self) -> None:
        pubkey = self.keygen()
        no_key = self.env_file("nokey.env", LCHAT_RELEASE_URL=self.url)
        refused = lchat("release", "fetch", "1.0.0", "--env-file", no_key)
        self.assertEqual(refused.returncode, 1, refused)
        self.assertIn("lchat: error: LCHAT_RELEASE_PUBKEY is not set", refused.stderr)

        down = self.env_file(
            "down.env",
            LCHAT_RELEASE_URL=closed_port_url(),
            LCHAT_RELEASE_MIRROR_URL=self.mirror,
            LCHAT_RELEASE_PUBKEY=pubkey,
        )
        refused = lchat("release", "fetch", "1.0.0", "--env-file", down)
        self.assertEqual(refused.returncode, 1, refused)
        errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("lchat: error: ")]
        self.assertEqual(len(errors), 1, refused.stderr)
        self.assertIn("no usable release feed, nothing changed: primary", errors[0])
        self.assertIn("mirror s3://", errors[0])
        self.assertFalse(os.path.exists(self.opt))

        bad = self.env_file("bad.env", LCHAT_RELEASE_PUBKEY="bm90IGEga2V5")
        refused = lchat("release", "fetch", "1.0.0", "--env-file", bad)
        self.assertIn("must be 32 bytes", refused.stderr)
        refused = lchat("release", "fetch", "../etc", "--env-file", down)
        self.assertIn("is not a version name", refused.stderr)


class ChannelAgentTests(TestCase):
    """``lchat release agent --once`` on a mesh box following the canary channel: outside its
    window it waits; inside, it starts the channel's rollout, fetches the build from the signed
    feed and takes it (a box with no space yet: its default build), and the rollout is done. The
    mesh bucket is a ``file:`` one; no router runs (the fleet's real-router test is
    test_deploy_mesh.FleetRolloutTests)."""

    timeout = 120

    def test_canary_channel_self_updates_inside_its_window(self) -> None:
        tmp = tempfile.mkdtemp(prefix="ch")
        self.addCleanup(shutil.rmtree, tmp, True)
        www = os.path.join(tmp, "www")
        os.makedirs(os.path.join(www, "feed"))
        server, url = serve_directory(www)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        key = Ed25519PrivateKey.generate()
        build = os.path.join(tmp, "build")
        os.makedirs(build)
        with open(os.path.join(build, "space"), "w") as f:
            f.write("#!/bin/sh\necho 1.1.0\n")
        os.chmod(os.path.join(build, "space"), 0o755)
        now = datetime.datetime.now(datetime.UTC)
        target = DirectoryTarget(os.path.join(www, "feed"))
        runner.run(lambda _: publish("1.1.0", build, key, [target], now, channel="canary"))

        opt, data, bucket = (os.path.join(tmp, d) for d in ("opt", "data", "bucket"))
        os.makedirs(data)
        os.makedirs(bucket)

        def box_env(window: str) -> str:
            path = os.path.join(tmp, "router.env")
            settings = {
                "LCHAT_DATA_DIR": data,
                "LCHAT_RUN_DIR": tmp,
                "LCHAT_OPT_DIR": opt,
                "LCHAT_SPACE_COMMAND": os.path.join(opt, "live", "{host}"),
                "LCHAT_HIBERNATE_BUCKET": f"file:{bucket}",
                "LCHAT_MESH_SELF": "https://box-1.example.net",
                "LCHAT_MESH_DOMAINS": DOMAIN,
                "LCHAT_MESH_TOKEN": TOKEN,
                "LCHAT_RELEASE_URL": url,
                "LCHAT_RELEASE_PUBKEY": feedlib.public_key_text(key.public_key()),
                "LCHAT_RELEASE_CHANNEL": "canary",
                "LCHAT_RELEASE_WINDOW": window,
            }
            with open(path, "w") as f:
                f.write("".join(f"{k}={v}\n" for k, v in settings.items()))
            return path

        def hhmm(hours: float) -> str:
            return (now + datetime.timedelta(hours=hours)).strftime("%H:%M")

        waited = lchat("release", "agent", "--once", "--env-file", box_env(f"{hhmm(2)}-{hhmm(3)}"))
        self.assertEqual(waited.returncode, 0, waited)
        self.assertIn("channel canary names 1.1.0, newer than -: waiting for", waited.stdout)
        store = FileStore(Clock(), bucket, run_in_thread=inline)
        self.assertEqual(
            self.successResultOf(Deferred.fromCoroutine(store.list("release/rollout"))), []
        )

        took = lchat("release", "agent", "--once", "--env-file", box_env(f"{hhmm(-1)}-{hhmm(1)}"))
        self.assertEqual(took.returncode, 0, took)
        self.assertIn("started rollout", took.stdout)
        self.assertIn("1.1.0: installed in", took.stdout)
        self.assertIn("default build: - -> 1.1.0", took.stdout)
        self.assertIn("release agent: reported done", took.stdout)
        self.assertEqual(BuildLayout(opt).version_of("_default"), "1.1.0")
        store = FileStore(Clock(), bucket, run_in_thread=inline)
        stored = self.successResultOf(Deferred.fromCoroutine(store.get("release/rollout.json")))
        record = json.loads(stored.body)
        self.assertEqual(
            (record["version"], record["state"], record["by"]),
            ("1.1.0", "done", "channel canary (https://box-1.example.net)"),
        )

    def test_off_a_mesh_the_fleet_commands_say_so(self) -> None:
        tmp = tempfile.mkdtemp(prefix="ch")
        self.addCleanup(shutil.rmtree, tmp, True)
        env_file = os.path.join(tmp, "router.env")
        with open(env_file, "w") as f:
            f.write(f"LCHAT_DATA_DIR={tmp}\nLCHAT_RUN_DIR={tmp}\n")
        for args in (("deploy", "2.0", "--fleet"), ("release", "agent", "--once")):
            ran = lchat(*args, "--env-file", env_file)
            self.assertEqual(ran.returncode, 1, ran)
            self.assertIn("this box is not on a mesh (LCHAT_MESH_SELF is not set)", ran.stderr)
        ran = lchat("deploy", "--all", "--env-file", env_file)
        self.assertEqual(ran.returncode, 1, ran)
        self.assertIn("which version?", ran.stderr)

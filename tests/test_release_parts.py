"""The small parts of lchat.release: settings, the manifest's checks, wake records, live links."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from twisted.trial.unittest import SynchronousTestCase

from lchat import builds
from lchat.builds import BuildLayout, fall_back_to_default
from lchat.release import deploy
from lchat.release import feed as feedlib
from lchat.release import settings as settings_mod
from lchat.release.fetch import Accepted, read_state, staleness, write_state


class SettingsTests(SynchronousTestCase):
    def test_defaults_and_the_environment_over_the_file(self) -> None:
        s = settings_mod.read({}, {})
        self.assertEqual((s.opt_dir, s.url, s.mirror, s.pubkey), ("/opt/lchat", "", None, ""))
        s = settings_mod.read(
            {"LCHAT_RELEASE_URL": "https://releases.example.com/lchat/", "LCHAT_OPT_DIR": "/a"},
            {"LCHAT_OPT_DIR": "/b"},
        )
        self.assertEqual((s.url, s.opt_dir), ("https://releases.example.com/lchat", "/b"))
        self.assertEqual(s.state_file, "/b/release-state.json")
        self.assertEqual(s.feed_validity, datetime.timedelta(days=7))
        s = settings_mod.read({"LCHAT_RELEASE_FEED_VALIDITY": "36h"}, {})
        self.assertEqual(s.feed_validity, datetime.timedelta(hours=36))

    def test_mirror_url_in_the_bucket_variables_form(self) -> None:
        s = settings_mod.read(
            {
                "LCHAT_RELEASE_MIRROR_URL": "s3://rel-mirror/feed?region=eu-west-1&endpoint=http://127.0.0.1:9"
            },
            {},
        )
        assert s.mirror is not None
        self.assertEqual(
            (s.mirror.bucket, s.mirror.prefix, s.mirror.s3_region, s.mirror.endpoint),
            ("rel-mirror", "feed", "eu-west-1", "http://127.0.0.1:9"),
        )

    def test_bad_values_name_the_variable(self) -> None:
        for name, value, fragment in [
            ("LCHAT_OPT_DIR", "opt", "must be an absolute path"),
            ("LCHAT_RELEASE_URL", "ftp://x/y", "must be an http(s) URL"),
            ("LCHAT_RELEASE_MIRROR_URL", "http://bucket", "LCHAT_RELEASE_MIRROR_URL"),
            ("LCHAT_RELEASE_FEED_VALIDITY", "week", "is not a duration"),
            ("LCHAT_RELEASE_FEED_VALIDITY", "10m", "must be between 1h and 365d"),
            ("LCHAT_RELEASE_FEED_VALIDITY", "400d", "must be between 1h and 365d"),
        ]:
            with self.assertRaises(settings_mod.SettingsError) as e:
                settings_mod.read({name: value}, {})
            self.assertIn(fragment, str(e.exception))


class ManifestTests(SynchronousTestCase):
    def manifest(self, **artefact: object) -> bytes:
        space = {"path": "versions/1/space", "sha256": "a" * 64, "size": 3, "mode": "0755"}
        space.update(artefact)
        doc = {"feed_version": 3, "versions": {"1": {"artefacts": {"space": space}}}}
        return json.dumps(doc).encode()

    def test_a_good_manifest(self) -> None:
        feed = feedlib.parse(self.manifest())
        self.assertEqual(feed.feed_version, 3)
        self.assertEqual(feed.versions["1"].artefacts["space"].mode, 0o755)
        self.assertEqual(feed.digest, feedlib.digest(self.manifest()))

    def test_unsafe_entries_are_refused(self) -> None:
        for field, value, fragment in [
            ("path", "../../etc/passwd", "is not a relative path"),
            ("path", "/etc/passwd", "is not a relative path"),
            ("sha256", "A" * 64, "is not 64 lowercase hex"),
            ("size", -1, "is not a byte count"),
            ("mode", "0777", "without group/other write"),
        ]:
            with self.assertRaises(feedlib.FeedError) as e:
                feedlib.parse(self.manifest(**{field: value}))
            self.assertIn(fragment, str(e.exception))
        bad_version = json.dumps({"feed_version": 1, "versions": {"..": {}}}).encode()
        with self.assertRaises(feedlib.FeedError):
            feedlib.parse(bad_version)

    def test_the_signature_covers_the_exact_bytes_and_a_context(self) -> None:
        key = Ed25519PrivateKey.generate()
        data = self.manifest()
        sig = feedlib.sign(key, data)
        feedlib.verify(key.public_key(), data, sig)
        with self.assertRaises(feedlib.BadSignature):
            feedlib.verify(key.public_key(), data + b" ", sig)
        # A bare signature of the bytes (no context) is not a feed signature.
        import base64

        bare = base64.b64encode(key.sign(data))
        with self.assertRaises(feedlib.BadSignature):
            feedlib.verify(key.public_key(), data, bare)
        text = feedlib.public_key_text(key.public_key())
        self.assertEqual(feedlib.public_key_text(feedlib.public_key_from_text(text)), text)


class StateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rs")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def test_staleness(self) -> None:
        feed = feedlib.Feed(5, "", {}, "d" * 64)
        self.assertIsNone(staleness(feed, None))
        self.assertIsNone(staleness(feed, Accepted(4, "x", 0, "primary")))
        self.assertIsNone(staleness(feed, Accepted(5, "d" * 64, 0, "primary")))
        self.assertIn("other contents", staleness(feed, Accepted(5, "e" * 64, 0, "")) or "")
        self.assertIn("stale", staleness(feed, Accepted(6, "e" * 64, 0, "")) or "")

    def test_round_trip_and_a_damaged_file_is_an_error(self) -> None:
        path = os.path.join(self.dir, "opt", "release-state.json")
        self.assertIsNone(read_state(path))
        write_state(path, Accepted(7, "f" * 64, 1.5, "mirror"))
        self.assertEqual(read_state(path), Accepted(7, "f" * 64, 1.5, "mirror"))
        with open(path, "w") as f:
            f.write("{")
        with self.assertRaises(feedlib.FeedError) as e:
            read_state(path)
        self.assertIn("newest feed this box accepted", str(e.exception))


class WakeAndLinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rw")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.layout = BuildLayout(os.path.join(self.dir, "opt"))
        for version in ("1.0", "2.0"):
            os.makedirs(self.layout.build_dir(version))
            with open(self.layout.binary(version), "w") as f:
                f.write("#!/bin/sh\n")

    def test_links_are_relative_and_replaced_atomically(self) -> None:
        deploy.point(self.layout, "a.example", "1.0")
        self.assertEqual(os.readlink(self.layout.live_link("a.example")), "../versions/1.0/space")
        deploy.point(self.layout, "a.example", "2.0")
        self.assertEqual(self.layout.version_of("a.example"), "2.0")
        self.assertEqual(sorted(os.listdir(self.layout.live_dir)), ["a.example"])  # no temp left
        deploy.point(self.layout, "a.example", None)
        self.assertIsNone(self.layout.version_of("a.example"))

    def test_a_host_without_a_link_runs_the_default_build(self) -> None:
        live = self.layout.live_link("a.example")
        argv = [live, "--flag"]
        self.assertEqual(fall_back_to_default(argv, "a.example"), argv)  # no default either
        self.assertIsNone(self.layout.version_of("a.example"))
        deploy.point(self.layout, "_default", "1.0")
        default = self.layout.live_link("_default")
        self.assertEqual(fall_back_to_default(argv, "a.example"), [default, "--flag"])
        self.assertEqual(self.layout.version_of("a.example"), "1.0")
        self.assertEqual(
            fall_back_to_default([live + "-bot"], "a.example", sidecar=True), [live + "-bot"]
        )  # no default sidecar
        deploy.point(self.layout, "a.example", "2.0")  # its own link wins
        self.assertEqual(fall_back_to_default(argv, "a.example"), argv)
        self.assertEqual(self.layout.version_of("a.example"), "2.0")
        other = ["/usr/bin/space", "a.example"]  # not a live link: never rewritten
        self.assertEqual(fall_back_to_default(other, "a.example"), other)

    def test_a_wake_records_the_build_behind_the_link(self) -> None:
        data = os.path.join(self.dir, "data")
        deploy.point(self.layout, "a.example", "2.0")
        wake = builds.record(data, "a.example", self.layout.live_link("a.example"), lambda: 9.0)
        self.assertEqual((wake.version, wake.at), ("2.0", 9.0))
        self.assertEqual(builds.read_wake(data, "a.example"), wake)
        self.assertIsNone(builds.read_wake(data, "b.example"))
        self.assertIsNone(builds.record(data, "c.example", "python3").version)
        builds.record_quietly("/proc/no/such/dir", "d.example", "/bin/sh")  # logged, never raised
        self.flushLoggedErrors()

"""The signed release feed, end to end: a primary served by a real HTTP server on 127.0.0.1, an S3
mirror on moto's server, builds published by ``lchat.release.publish`` and installed by
``lchat.release.fetch`` into a temporary ``<opt>``."""

from __future__ import annotations

import datetime
import functools
import http.server
import json
import os
import shutil
import socket
import tempfile
import threading
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from lchat.builds import BuildLayout
from lchat.objstore.s3 import S3Store
from lchat.release import feed as feedlib
from lchat.release.fetch import (
    FETCHES,
    BucketSource,
    Fetcher,
    HttpSource,
    NoUsableFeed,
    http_client,
    read_state,
)
from lchat.release.publish import BucketTarget, DirectoryTarget, publish, refresh
from tests.s3servers import shared_server, store_for

NOW = datetime.datetime(2026, 12, 2, 3, 0, tzinfo=datetime.UTC)
DAY = 86400.0


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_directory(root: str) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/feed"


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/feed"


class FeedTestCase(TestCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]  # trial waits for it
        self.tmp = tempfile.mkdtemp(prefix="rf")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.www = os.path.join(self.tmp, "www")
        self.primary_dir = os.path.join(self.www, "feed")
        os.makedirs(self.primary_dir)
        server, self.url = serve_directory(self.www)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        self.s3 = await shared_server("moto")
        self.bucket = await self.s3.new_bucket()
        self.store: S3Store = store_for(self.s3, self.bucket)
        self.addCleanup(self.store.close)
        self.key = Ed25519PrivateKey.generate()
        self.opt = os.path.join(self.tmp, "opt")
        self.layout = BuildLayout(self.opt)
        self.state = os.path.join(self.opt, "release-state.json")
        self.primary_target = DirectoryTarget(self.primary_dir)
        self.mirror_target = BucketTarget(self.store, "releases", f"s3://{self.bucket}/releases")

    def build(self, version: str, *, bot: bool = False) -> str:
        directory = os.path.join(self.tmp, "builds", version)
        os.makedirs(directory)
        for name in ("space", "space-bot") if bot else ("space",):
            path = os.path.join(directory, name)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\necho {name} {version}\n")
            os.chmod(path, 0o755)
        return directory

    async def publish(self, version: str, *targets: object, bot: bool = False) -> feedlib.Feed:
        chosen = list(targets) or [self.primary_target, self.mirror_target]
        return await publish(version, self.build(version, bot=bot), self.key, chosen, NOW)  # type: ignore[arg-type]

    def fetcher(self, primary: str | None = None, mirror: bool = True, at: float = 60.0) -> Fetcher:
        """A box fetching ``at`` seconds after NOW (the feeds' publishing time)."""
        http = HttpSource(primary or self.url, http_client(reactor), reactor)
        bucket = BucketSource(self.store, "releases", f"s3://{self.bucket}/releases")
        return Fetcher(
            layout=self.layout,
            pubkey=self.key.public_key(),
            state_file=self.state,
            primary=http,
            mirror=bucket if mirror else None,
            clock=lambda: NOW.timestamp() + at,
        )

    def primary_files(self) -> dict[str, bytes]:
        names = (feedlib.FEED_NAME, feedlib.SIGNATURE_NAME)
        result = {}
        for name in names:
            with open(os.path.join(self.primary_dir, name), "rb") as f:
                result[name] = f.read()
        return result

    def restore_primary(self, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            with open(os.path.join(self.primary_dir, name), "wb") as f:
                f.write(data)

    async def mirror_files(self) -> dict[str, bytes]:
        return {
            name: (await self.store.get(f"releases/{name}")).body
            for name in (feedlib.FEED_NAME, feedlib.SIGNATURE_NAME)
        }

    async def restore_mirror(self, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            await self.store.put(f"releases/{name}", data)

    def opt_listing(self) -> list[str]:
        found = []
        for directory, dirs, names in os.walk(self.opt):
            for name in dirs + names:
                found.append(os.path.relpath(os.path.join(directory, name), self.opt))
        return sorted(found)

    def tamper_primary(self, path: str, *, grow: bool = False) -> None:
        """Change the primary's copy of ``path``: the same size (a flipped build), or longer."""
        full = os.path.join(self.primary_dir, path)
        with open(full, "rb") as f:
            data = f.read()
        with open(full, "wb") as f:
            f.write(data + b"echo owned\n" if grow else data.replace(b"echo", b"rm -", 1))


class GoodFetchTests(FeedTestCase):
    async def test_installs_the_build_with_its_modes_and_records_the_feed(self) -> None:
        published = await self.publish("1.0.0", bot=True)
        what, _, source = await self.fetcher().fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "primary"))
        self.assertEqual(self.layout.installed(), ["1.0.0"])
        space = self.layout.binary("1.0.0")
        self.assertEqual(read_bytes(space), b"#!/bin/sh\necho space 1.0.0\n")
        self.assertEqual(os.stat(space).st_mode & 0o777, 0o755)
        self.assertEqual(read_bytes(self.layout.binary("1.0.0", sidecar=True))[:9], b"#!/bin/sh")
        state = read_state(self.state)
        assert state is not None
        self.assertEqual((state.feed_version, state.digest), (1, published.digest))
        # The feed's order of builds, for the build floor (lchat.builds.compare_versions).
        self.assertEqual(dict(state.released), {"1.0.0": published.versions["1.0.0"].released_at})
        # Nothing but the build and the state: no temp directory left beside it.
        self.assertEqual(
            self.opt_listing(),
            [
                "release-state.json",
                "versions",
                "versions/1.0.0",
                "versions/1.0.0/space",
                "versions/1.0.0/space-bot",
            ],
        )
        again = await self.fetcher().fetch("1.0.0")
        self.assertEqual(again[0], "already installed")

    async def test_each_publish_bumps_the_feed_version_and_keeps_older_versions(self) -> None:
        await self.publish("1.0.0")
        second = await self.publish("1.1.0")
        self.assertEqual(second.feed_version, 2)
        self.assertEqual(sorted(second.versions), ["1.0.0", "1.1.0"])
        with self.assertRaises(feedlib.FeedError) as e:
            await publish("1.1.0", self.build("1.1.0b"), self.key, [self.primary_target], NOW)
        self.assertIn("already in the feed", str(e.exception))

    async def test_unknown_version_names_what_the_feed_has(self) -> None:
        await self.publish("1.0.0")
        with self.assertRaises(feedlib.FeedError) as e:
            await self.fetcher().fetch("9.9.9")
        self.assertIn("version 9.9.9 is not in the feed", str(e.exception))
        self.assertIn("1.0.0", str(e.exception))
        self.assertEqual(self.layout.installed(), [])


class TamperTests(FeedTestCase):
    async def test_tampered_artefact_on_the_primary_is_taken_from_the_mirror(self) -> None:
        await self.publish("1.0.0")
        self.tamper_primary("versions/1.0.0/space")
        what, _, source = await self.fetcher().fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "primary"))  # the feed is the primary's
        # The bytes are the mirror's good copy.
        self.assertIn(b"echo space", read_bytes(self.layout.binary("1.0.0")))

    async def test_tampered_artefact_everywhere_is_refused_and_leaves_nothing(self) -> None:
        await self.publish("1.0.0")
        self.tamper_primary("versions/1.0.0/space")
        with self.assertRaises(feedlib.FeedError) as e:
            await self.fetcher(mirror=False).fetch("1.0.0")
        self.assertIn("is not the feed's", str(e.exception))
        self.assertIn("nothing installed", str(e.exception))
        self.assertEqual(self.layout.installed(), [])
        self.assertEqual(os.listdir(self.layout.versions_dir), [])  # no temp dir left either

    async def test_a_longer_artefact_is_cut_off_and_refused(self) -> None:
        await self.publish("1.0.0")
        self.tamper_primary("versions/1.0.0/space", grow=True)
        with self.assertRaises(feedlib.FeedError) as e:
            await self.fetcher(mirror=False).fetch("1.0.0")
        self.assertIn("larger than the feed's", str(e.exception))
        self.assertEqual(os.listdir(self.layout.versions_dir), [])

    async def test_bad_signature_on_the_primary_falls_back_to_the_mirror(self) -> None:
        await self.publish("1.0.0")
        other = Ed25519PrivateKey.generate()
        data = read_bytes(os.path.join(self.primary_dir, "feed.json"))
        write_bytes(os.path.join(self.primary_dir, "feed.json.sig"), feedlib.sign(other, data))
        what, _, source = await self.fetcher().fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "mirror"))

    async def test_a_feed_edited_after_signing_is_refused_everywhere(self) -> None:
        await self.publish("1.0.0")
        doc = json.loads((await self.store.get("releases/feed.json")).body)
        doc["versions"]["1.0.0"]["artefacts"]["space"]["sha256"] = "0" * 64
        edited = json.dumps(doc).encode()
        await self.store.put("releases/feed.json", edited)
        write_bytes(os.path.join(self.primary_dir, "feed.json"), edited)
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher().fetch("1.0.0")
        message = str(e.exception)
        self.assertIn("primary", message)
        self.assertIn("mirror", message)
        self.assertIn("does not verify against LCHAT_RELEASE_PUBKEY", message)
        self.assertEqual(self.opt_listing(), [])  # nothing changed: not even the state


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Promises a feed, sends ten bytes of it, then goes quiet."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"feed_ver')
        self.wfile.flush()
        time.sleep(10)

    def log_message(self, format: str, *args: object) -> None:
        pass


class SlowPrimaryTests(FeedTestCase):
    async def test_a_body_that_never_ends_is_given_up_on_and_the_mirror_used(self) -> None:
        await self.publish("1.0.0")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        slow = HttpSource(
            f"http://127.0.0.1:{server.server_address[1]}/feed",
            http_client(reactor),
            reactor,
            body_timeout=0.5,
        )
        fetcher = Fetcher(
            layout=self.layout,
            pubkey=self.key.public_key(),
            state_file=self.state,
            primary=slow,
            mirror=BucketSource(self.store, "releases", f"s3://{self.bucket}/releases"),
        )
        what, _, source = await fetcher.fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "mirror"))
        fetcher = Fetcher(self.layout, self.key.public_key(), self.state, slow, None)
        with self.assertRaises(NoUsableFeed) as e:
            await fetcher.feed()
        self.assertIn("the body did not arrive within 0.5s", str(e.exception))


class AntiRollbackTests(FeedTestCase):
    async def test_stale_primary_the_mirror_wins(self) -> None:
        await self.publish("1.0.0")
        old_primary = self.primary_files()
        await self.publish("1.1.0")
        await self.fetcher().fetch("1.1.0")  # this box accepts feed_version 2
        self.restore_primary(old_primary)  # the primary's CDN serves the old, validly signed feed
        what, _, source = await self.fetcher().fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "mirror"))
        state = read_state(self.state)
        assert state is not None
        self.assertEqual(state.feed_version, 2)

    async def test_stale_mirror_too_is_refused(self) -> None:
        await self.publish("1.0.0")
        old_primary, old_mirror = self.primary_files(), await self.mirror_files()
        await self.publish("1.1.0")
        await self.fetcher().fetch("1.1.0")
        before = self.opt_listing()
        self.restore_primary(old_primary)
        await self.restore_mirror(old_mirror)
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher().fetch("1.0.0")
        message = str(e.exception)
        self.assertIn("nothing changed", message)
        self.assertEqual(message.count("stale: feed_version 1, older than the feed_version 2"), 2)
        self.assertEqual(self.opt_listing(), before)
        self.assertNotIn("1.0.0", self.layout.installed())

    async def test_same_feed_version_with_other_contents_is_refused(self) -> None:
        await self.publish("1.0.0")
        await self.fetcher().fetch("1.0.0")
        # A second feed_version 1 signed by the same key (a replayed or forked feed).
        fork = await publish(
            "1.0.1",
            self.build("1.0.1"),
            self.key,
            [DirectoryTarget(os.path.join(self.tmp, "f"))],
            NOW,
        )
        data = fork.to_bytes()
        self.restore_primary({"feed.json": data, "feed.json.sig": feedlib.sign(self.key, data)})
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher(mirror=False).fetch("1.0.1")
        self.assertIn("other contents", str(e.exception))

    async def test_both_down_is_a_clear_error_and_changes_nothing(self) -> None:
        missing = BucketSource(self.store, "nowhere", f"s3://{self.bucket}/nowhere")
        fetcher = Fetcher(
            layout=self.layout,
            pubkey=self.key.public_key(),
            state_file=self.state,
            primary=HttpSource(closed_port_url(), http_client(reactor), reactor),
            mirror=missing,
        )
        with self.assertRaises(NoUsableFeed) as e:
            await fetcher.fetch("1.0.0")
        message = str(e.exception)
        self.assertTrue(message.startswith("no usable release feed, nothing changed: primary"))
        self.assertIn("ConnectionRefused", message)
        self.assertIn("no object nowhere/feed.json", message)
        self.assertEqual(self.opt_listing(), [])  # <opt> was not even created


class FreshnessTests(FeedTestCase):
    """A signed ``expires_at``: a primary or mirror cannot freeze a box on an old feed, and a
    fresh box (no release-state.json) does not take just any old signed feed."""

    async def test_a_feed_past_its_expiry_is_refused_saying_so(self) -> None:
        published = await self.publish("1.0.0")  # valid for 7 days by default
        self.assertEqual(published.expires_at, "2026-12-09T03:00:00Z")
        before = FETCHES.labels("primary", "expired")._value.get()
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher(at=8 * DAY).fetch("1.0.0")  # a fresh box, a week later
        message = str(e.exception)
        self.assertEqual(message.count("expired at 2026-12-09T03:00:00Z (1 day ago)"), 2, message)
        self.assertIn("lchat release refresh", message)
        self.assertEqual(FETCHES.labels("primary", "expired")._value.get() - before, 1)
        self.assertEqual(self.opt_listing(), [])  # nothing accepted, nothing installed

    async def test_a_feed_within_its_expiry_is_accepted(self) -> None:
        await self.publish("1.0.0")
        what, _, source = await self.fetcher(at=7 * DAY - 60).fetch("1.0.0")
        self.assertEqual((what, source), ("installed", "primary"))

    async def test_a_tampered_expires_at_fails_the_signature(self) -> None:
        await self.publish("1.0.0")
        data = read_bytes(os.path.join(self.primary_dir, "feed.json"))
        self.assertIn(b'"expires_at": "2026-12-09T03:00:00Z"', data)
        extended = data.replace(b"2026-12-09T03:00:00Z", b"2036-12-09T03:00:00Z")
        write_bytes(os.path.join(self.primary_dir, "feed.json"), extended)
        await self.store.put("releases/feed.json", extended)
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher(at=8 * DAY).fetch("1.0.0")
        self.assertEqual(str(e.exception).count("does not verify against LCHAT_RELEASE_PUBKEY"), 2)

    async def test_a_feed_without_expires_at_is_refused(self) -> None:
        # What a release host signed before feeds expired: validly signed, but unbounded.
        await self.publish("1.0.0")
        doc = json.loads(read_bytes(os.path.join(self.primary_dir, "feed.json")))
        del doc["expires_at"]
        legacy = json.dumps(doc).encode()
        self.restore_primary({"feed.json": legacy, "feed.json.sig": feedlib.sign(self.key, legacy)})
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher(mirror=False).fetch("1.0.0")
        self.assertIn("has no expires_at", str(e.exception))
        self.assertIn("lchat release refresh", str(e.exception))

    async def test_refresh_re_signs_the_same_builds_with_a_later_expiry(self) -> None:
        await self.publish("1.0.0")
        await self.fetcher(at=60).fetch("1.0.0")
        later = NOW + datetime.timedelta(days=6)
        refreshed = await refresh(
            self.key, [self.primary_target, self.mirror_target], later, datetime.timedelta(days=3)
        )
        self.assertEqual(
            (refreshed.feed_version, sorted(refreshed.versions), refreshed.expires_at),
            (2, ["1.0.0"], "2026-12-11T03:00:00Z"),
        )
        feed, source, _ = await self.fetcher(at=8 * DAY).feed()
        self.assertEqual((feed.feed_version, source), (2, "primary"))
        # A publish keeps the validity it is given, and the builds listed before.
        published = await publish(
            "1.1.0",
            self.build("1.1.0"),
            self.key,
            [self.primary_target],
            later,
            valid_for=datetime.timedelta(hours=12),
        )
        self.assertEqual(
            (published.feed_version, published.expires_at), (3, "2026-12-08T15:00:00Z")
        )


class ChannelTests(FeedTestCase):
    async def test_channels_are_signed_and_old_parsers_ignore_them(self) -> None:
        build = self.build("1.3.2")
        targets = [self.primary_target, self.mirror_target]
        await publish("1.3.2", build, self.key, targets, NOW, channel="stable")  # type: ignore[arg-type]
        published = await publish(
            "1.4.0",
            self.build("1.4.0"),
            self.key,
            targets,  # type: ignore[arg-type]
            NOW,
            channel="canary",
        )
        self.assertEqual(dict(published.channels), {"stable": "1.3.2", "canary": "1.4.0"})
        feed, _, _ = await self.fetcher().feed()
        self.assertEqual(dict(feed.channels), {"stable": "1.3.2", "canary": "1.4.0"})
        refreshed = await refresh(self.key, targets, NOW)  # type: ignore[arg-type]
        self.assertEqual(dict(refreshed.channels), dict(feed.channels))  # a refresh keeps them

        # Old parsers read only the keys they know: a feed with a top-level key they never heard
        # of parses (the channels' case for a box older than channels).
        doc = json.loads(refreshed.to_bytes())
        self.assertIn("channels", doc)
        doc["a_future_key"] = {"anything": 1}
        self.assertEqual(feedlib.parse(json.dumps(doc).encode()).feed_version, 3)

        # The channels are inside the signed bytes: moving one breaks the signature.
        doc = json.loads((await self.store.get("releases/feed.json")).body)
        doc["channels"]["stable"] = "1.4.0"
        edited = json.dumps(doc).encode()
        await self.store.put("releases/feed.json", edited)
        write_bytes(os.path.join(self.primary_dir, "feed.json"), edited)
        with self.assertRaises(NoUsableFeed) as e:
            await self.fetcher().feed()
        self.assertIn("does not verify against LCHAT_RELEASE_PUBKEY", str(e.exception))

    def test_a_channel_names_a_listed_version_of_a_known_channel(self) -> None:
        base = {"feed_version": 1, "versions": {}, "expires_at": "2026-12-09T03:00:00Z"}
        for channels, why in (
            ({"stable": "9.9"}, "channel stable names '9.9', which the feed does not list"),
            ({"nightly": "9.9"}, "'nightly' is not a release channel (stable or canary)"),
            (["stable"], "channels is not an object"),
        ):
            with self.assertRaises(feedlib.FeedError) as e:
                feedlib.parse(json.dumps(base | {"channels": channels}).encode())
            self.assertIn(why, str(e.exception))

"""The build floor (lchat.hibernation.floor, lchat.builds): which build is newer, the record's
format, and every decision a wake makes against a real ``file:`` bucket, on a fake clock.

The promise end to end, across two real routers, is in test_deploy_mesh; the single box in
test_deploy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from lchat import builds
from lchat.builds import BadRecord, BuildLayout, BuildRecord, compare_versions, release_number
from lchat.hibernation.floor import BEHIND_RETRY, LIFTS, WRITES, BuildFloor, sidecar_argv
from lchat.hibernation.space import WakeFailed
from lchat.objstore import NotFound
from lchat.objstore.file import FileStore
from lchat.release import deploy
from lchat.release.fetch import Accepted, write_state
from tests.fakes import inline

HOST = "h.example.com"
EPOCH = 1_790_000_000.0


class OrderTests(SynchronousTestCase):
    def test_release_numbers_order_dotted_names_and_nothing_else(self) -> None:
        self.assertEqual(release_number("1.4.0"), (1, 4))
        self.assertEqual(release_number("v2"), (2,))
        self.assertEqual(release_number("0"), (0,))
        for unordered in ("abc123", "1.4.0rc1", "1.4-hotfix", "1..4"):
            self.assertIsNone(release_number(unordered), unordered)

    def test_the_numbers_decide_when_both_have_them_else_the_feed(self) -> None:
        self.assertEqual(compare_versions("1.3", "1.4", {}), -1)
        self.assertEqual(compare_versions("1.10", "1.9", {}), 1)  # numbers, not text
        self.assertEqual(compare_versions("1.4", "1.4.0", {}), 0)
        self.assertEqual(compare_versions("v2", "v1", {}), 1)
        self.assertIsNone(compare_versions("abc123", "def456", {}))
        self.assertIsNone(compare_versions("1.4", "abc123", {}))
        feed = {"abc123": "2026-12-01T00:00:00Z", "def456": "2026-12-02T00:00:00Z"}
        self.assertEqual(compare_versions("def456", "abc123", feed), 1)
        # A hotfix on an older line published after the newer one is still older: it does not
        # know the newer line's migrations, so the numbers win over the feed's dates.
        both = {"2.0": "2026-12-01T00:00:00Z", "1.9.1": "2026-12-02T00:00:00Z"}
        self.assertEqual(compare_versions("1.9.1", "2.0", both), -1)
        # A name without numbers: the feed's order, when both are in it.
        mixed = {"2.0": "2026-12-01T00:00:00Z", "abc123": "2026-12-02T00:00:00Z"}
        self.assertEqual(compare_versions("abc123", "2.0", mixed), 1)
        self.assertIsNone(compare_versions("abc123", "2.0", {"2.0": "2026-12-01T00:00:00Z"}))

    def test_a_record_round_trips_and_a_bad_one_is_named(self) -> None:
        record = BuildRecord("1.4", EPOCH, "box-a")
        self.assertEqual(BuildRecord.parse(record.to_bytes()), record)
        for body, why in (
            (b"nope", "not JSON"),
            (b"[]", "not a JSON object"),
            (b'{"version": "../x", "at": 1}', "not a version name"),
            (b'{"version": "1.4", "at": "soon"}', "not a time"),
        ):
            with self.assertRaises(BadRecord) as caught:
                BuildRecord.parse(body)
            self.assertIn(why, str(caught.exception))
        self.assertEqual(builds.record_key("spaces/", "H.Example.com"), f"spaces/{HOST}/build.json")


class FloorTests(SynchronousTestCase):
    """Each decision of :meth:`BuildFloor.hold`, on a real file bucket."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="floor")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.layout = BuildLayout(os.path.join(self.root, "opt"))
        self.clock = Clock()
        self.clock.advance(EPOCH)
        os.mkdir(os.path.join(self.root, "bucket"))
        self.store = FileStore(self.clock, os.path.join(self.root, "bucket"), run_in_thread=inline)
        self.floor = BuildFloor(self.store, "spaces", "box-b", inline, clock=self.clock.seconds)
        self.key = builds.record_key("spaces", HOST)
        self.logged: list[str] = []

        def observe(event: LogEvent) -> None:
            text = formatEvent(event)
            if text and "activator:" in text:
                self.logged.append(text)

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def install(self, version: str) -> str:
        os.makedirs(self.layout.build_dir(version), exist_ok=True)
        path = self.layout.binary(version)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(path, 0o755)
        return path

    def link(self, version: str) -> list[str]:
        """The host's argv with its live link at ``version``."""
        self.install(version)
        deploy.point(self.layout, HOST, version)
        return [self.layout.live_link(HOST), "--flag"]

    def hold(self, argv: list[str]) -> list[str]:
        result: list[str] = self.successResultOf(
            Deferred.fromCoroutine(self.floor.hold(HOST, argv))
        )
        return result

    def refused(self, argv: list[str]) -> WakeFailed:
        failure = self.failureResultOf(Deferred.fromCoroutine(self.floor.hold(HOST, argv)))
        assert isinstance(failure.value, WakeFailed)
        return failure.value

    def record(self) -> BuildRecord:
        got = self.successResultOf(Deferred.fromCoroutine(self.store.get(self.key)))
        return BuildRecord.parse(got.body)

    def put(self, body: bytes) -> None:
        self.successResultOf(Deferred.fromCoroutine(self.store.put(self.key, body)))

    def test_the_first_wake_writes_the_floor_and_a_newer_build_raises_it(self) -> None:
        first = WRITES.labels("first")._value.get()
        argv = self.link("1.3")
        self.assertEqual(self.hold(argv), argv)
        self.assertEqual(self.record(), BuildRecord("1.3", EPOCH, "box-b"))
        self.assertEqual(WRITES.labels("first")._value.get(), first + 1)

        raised = WRITES.labels("raised")._value.get()
        self.clock.advance(60)
        argv = self.link("1.4")
        self.assertEqual(self.hold(argv), argv)
        self.assertEqual(self.record(), BuildRecord("1.4", EPOCH + 60, "box-b"))
        self.assertEqual(WRITES.labels("raised")._value.get(), raised + 1)
        self.assertIn(f"activator: {HOST}: build floor 1.3 -> 1.4", self.logged)

        self.clock.advance(60)
        self.assertEqual(self.hold(argv), argv)  # the same build: nothing written
        self.assertEqual(self.record(), BuildRecord("1.4", EPOCH + 60, "box-b"))

    def test_an_older_link_wakes_on_the_floor_build_when_it_is_installed(self) -> None:
        self.put(BuildRecord("1.4", EPOCH - 3600, "box-a").to_bytes())
        floor_build = self.install("1.4")
        lifts = LIFTS._value.get()
        self.assertEqual(self.hold(self.link("1.3")), [floor_build, "--flag"])
        self.assertEqual(LIFTS._value.get(), lifts + 1)
        self.assertIn(
            f"activator: {HOST}: live link is 1.3, but it ran 1.4: waking on 1.4", self.logged
        )
        self.assertEqual(self.record(), BuildRecord("1.4", EPOCH - 3600, "box-a"))  # untouched

    def test_an_older_link_without_the_floor_build_is_a_503_naming_the_fix(self) -> None:
        self.put(BuildRecord("1.4", EPOCH - 3600, "box-a").to_bytes())
        refusal = self.refused(self.link("1.3"))
        self.assertEqual(refusal.reason, "build_behind")
        self.assertEqual(refusal.retry_after, BEHIND_RETRY)
        [line] = [t for t in self.logged if "not woken" in t]
        self.assertIn("live link is 1.3, but it ran 1.4 (on box-a at", line)
        self.assertIn("fetch it: `lchat release fetch 1.4`", line)
        self.assertEqual(self.record(), BuildRecord("1.4", EPOCH - 3600, "box-a"))

    def test_numbers_decide_before_the_feed_which_orders_names_without_numbers(self) -> None:
        # 1.9.1 came out after 2.0 (a hotfix on the older line): still older, it does not know
        # 2.0's migrations. Two hashes are ordered by the feed alone.
        released = {
            "2.0": "2026-12-01T00:00:00Z",
            "1.9.1": "2026-12-02T00:00:00Z",
            "abc123": "2026-12-03T00:00:00Z",
            "def456": "2026-12-04T00:00:00Z",
        }
        write_state(self.layout.release_state, Accepted(7, "d" * 64, EPOCH, "primary", released))
        self.put(BuildRecord("2.0", EPOCH - 3600, "box-a").to_bytes())
        refusal = self.refused(self.link("1.9.1"))
        self.assertEqual(refusal.reason, "build_behind")
        self.put(BuildRecord("abc123", EPOCH - 3600, "box-a").to_bytes())
        argv = self.link("def456")
        self.assertEqual(self.hold(argv), argv)
        self.assertEqual(self.record(), BuildRecord("def456", EPOCH, "box-b"))

    def test_a_damaged_feed_state_leaves_the_numbers_and_says_so_once(self) -> None:
        os.makedirs(self.layout.root, exist_ok=True)
        with open(self.layout.release_state, "w") as f:
            f.write("{")
        self.put(BuildRecord("1.4", EPOCH, "box-a").to_bytes())
        self.refused(self.link("1.3"))
        self.refused(self.link("1.3"))
        said = [t for t in self.logged if "order of builds is unknown" in t]
        self.assertEqual(len(said), 1, self.logged)

    def test_builds_without_an_order_are_allowed_recorded_and_warned_once(self) -> None:
        self.put(BuildRecord("abc123", EPOCH - 3600, "box-a").to_bytes())
        unordered = WRITES.labels("unordered")._value.get()
        argv = self.link("def456")
        self.assertEqual(self.hold(argv), argv)
        self.assertEqual(self.record(), BuildRecord("def456", EPOCH, "box-b"))
        self.assertEqual(self.hold(self.link("abc123")), [self.layout.live_link(HOST), "--flag"])
        self.assertEqual(WRITES.labels("unordered")._value.get(), unordered + 2)
        said = [t for t in self.logged if "cannot be enforced" in t]
        self.assertEqual(len(said), 1, self.logged)
        self.assertIn("no known order", said[0])

    def test_a_damaged_record_is_left_alone_and_named(self) -> None:
        self.put(b"not json")
        argv = self.link("1.3")
        self.assertEqual(self.hold(argv), argv)
        got = self.successResultOf(Deferred.fromCoroutine(self.store.get(self.key)))
        self.assertEqual(got.body, b"not json")
        [line] = [t for t in self.logged if "is not a build record" in t]
        self.assertIn(self.key, line)

    def test_a_build_in_no_version_tree_reads_nothing(self) -> None:
        argv = ["env", "python", "-m", "lchat.space"]
        self.assertEqual(self.hold(argv), argv)
        self.failureResultOf(Deferred.fromCoroutine(self.store.get(self.key)), NotFound)

    def test_a_record_written_since_the_read_is_read_again(self) -> None:
        # Another writer between our GET and PUT: the If-Match fails, the decision is redone.
        argv = self.link("1.3")
        store = self.store
        floor = self

        class Racing:
            """The real store, with one write landing between the floor's read and its write."""

            def __getattr__(self, name: str) -> object:
                return getattr(store, name)

            async def put(self, key: str, body: bytes, **options: object) -> object:
                if not getattr(self, "raced", False):
                    self.raced = True
                    await store.put(key, BuildRecord("1.4", EPOCH, "box-a").to_bytes())
                return await store.put(key, body, **options)  # type: ignore[arg-type]

        self.floor.store = Racing()  # type: ignore[assignment]
        self.install("1.4")
        self.assertEqual(self.hold(argv), [self.layout.binary("1.4"), "--flag"])
        self.assertEqual(floor.record(), BuildRecord("1.4", EPOCH, "box-a"))

    def test_a_lifted_wake_runs_the_floor_builds_sidecar_or_none(self) -> None:
        self.install("1.3")
        deploy.point(self.layout, HOST, "1.3")
        bot_link = self.layout.live_link(HOST, sidecar=True)
        os.makedirs(self.layout.build_dir("1.3"), exist_ok=True)
        with open(self.layout.binary("1.3", sidecar=True), "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(self.layout.binary("1.3", sidecar=True), 0o755)
        deploy.point(self.layout, HOST, "1.3", sidecar=True)
        argv = [bot_link, "--bot"]
        self.assertEqual(sidecar_argv(argv, None), argv)  # not lifted: the link's
        floor_dir = self.layout.build_dir("1.4")
        self.install("1.4")
        self.assertIsNone(sidecar_argv(argv, floor_dir))  # 1.4 has no sidecar: none runs
        with open(self.layout.binary("1.4", sidecar=True), "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(self.layout.binary("1.4", sidecar=True), 0o755)
        self.assertEqual(
            sidecar_argv(argv, floor_dir), [self.layout.binary("1.4", sidecar=True), "--bot"]
        )
        other = ["env", "bot"]  # a sidecar command in no version tree is left alone
        self.assertEqual(sidecar_argv(other, floor_dir), other)

    def test_the_release_state_keeps_the_feed_order(self) -> None:
        released = {"1.4": "2026-12-02T03:00:00Z"}
        write_state(self.layout.release_state, Accepted(3, "e" * 64, EPOCH, "mirror", released))
        with open(self.layout.release_state) as f:
            self.assertEqual(json.load(f)["released"], released)

"""The moved marker (lchat.hibernation.moved): each decision of :meth:`MovedCheck.check` on a
real file bucket and a fake clock. The relocation that writes it is in test_relocate_handover;
a box that missed the relocation's fan-out, on real routers, in test_relocate_mesh."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import cast

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from lchat.hibernation import moved
from lchat.hibernation.moved import MOVED_RETRY, BadMarker, MovedCheck, MovedRecord
from lchat.hibernation.space import WakeFailed
from lchat.objstore.file import FileStore
from tests.fakes import inline

HOST = "h.example.com"


class MarkerTests(SynchronousTestCase):
    def test_round_trip_and_bad_markers(self) -> None:
        record = MovedRecord("fi", 1_700_000_000_000, 12.5, "ie0")
        self.assertEqual(MovedRecord.parse(record.to_bytes()), record)
        self.assertEqual(moved.moved_key("prod/", HOST), f"prod/{HOST}/moved.json")
        self.assertEqual(moved.moved_key("", HOST), f"{HOST}/moved.json")
        for body, why in (
            (b"{", "not JSON"),
            (b"[]", "not a JSON object"),
            (b'{"gen": 1}', "is not a region"),
            (b'{"to": "fi", "gen": -1}', "is not a generation"),
            (b'{"to": "fi", "gen": true}', "is not a generation"),
            (b'{"to": "fi", "gen": 1, "at": "now"}', "is not a time"),
        ):
            with self.assertRaises(BadMarker) as caught:
                MovedRecord.parse(body)
            self.assertIn(why, str(caught.exception))


class CheckTests(SynchronousTestCase):
    """This box's bucket holds ``HOST``'s replica; its row says ``ie`` at some generation."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="moved")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.clock = Clock()
        os.mkdir(os.path.join(self.root, "bucket"))
        self.store = FileStore(self.clock, os.path.join(self.root, "bucket"), run_in_thread=inline)
        self.asked: list[str] = []
        self.check = MovedCheck(self.store, "prod", True, self.asked.append)
        self.logged: list[str] = []

        def observe(event: LogEvent) -> None:
            text = formatEvent(event)
            if text and "activator:" in text:
                self.logged.append(text)

        observer = cast(ILogObserver, observe)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def mark(self, body: bytes) -> None:
        key = moved.moved_key("prod", HOST)
        self.successResultOf(Deferred.fromCoroutine(self.store.put(key, body)))

    def passes(self, home: str = "ie", gen: int = 10) -> None:
        self.successResultOf(Deferred.fromCoroutine(self.check.check(HOST, home, gen)))

    def refused(self, home: str = "ie", gen: int = 10) -> WakeFailed:
        failure = self.failureResultOf(Deferred.fromCoroutine(self.check.check(HOST, home, gen)))
        assert isinstance(failure.value, WakeFailed)
        return failure.value

    def test_no_marker_wakes(self) -> None:
        self.passes()
        self.assertEqual((self.asked, self.logged), ([], []))

    def test_a_row_older_than_the_move_is_refused_and_the_peers_asked(self) -> None:
        self.mark(MovedRecord("fi", 20, 1.0, "ie0").to_bytes())
        why = self.refused(gen=10)
        self.assertEqual((why.reason, why.retry_after), ("moved", MOVED_RETRY))
        self.assertIn("moved to region fi (gen 20)", why.message)
        self.assertEqual(self.asked, [HOST])
        (line,) = self.logged
        self.assertIn(
            f"activator: {HOST}: not woken: it moved to region fi (settings gen 20, by ie0), "
            f"but this box's row still says ie (gen 10): it missed the relocation's fan-out",
            line,
        )
        self.assertIn("`lchat mesh-seed`", line)
        # A row without a region (created before regions) is as stale.
        self.assertEqual(self.refused(home="", gen=0).reason, "moved")

    def test_a_row_that_knows_the_move_or_is_newer_wakes(self) -> None:
        self.mark(MovedRecord("fi", 20).to_bytes())
        self.passes(home="fi", gen=20)  # (placement would not wake it here; the check agrees)
        self.passes(home="ie", gen=20)  # the row is the move's own generation or newer:
        self.passes(home="ie", gen=21)  # removed and added again since, say
        self.assertEqual(self.asked, [])

    def test_disabled_reads_nothing(self) -> None:
        self.mark(MovedRecord("fi", 20).to_bytes())
        self.check = MovedCheck(self.store, "prod", False, self.asked.append)
        self.passes(gen=1)
        self.assertEqual(self.asked, [])

    def test_a_bad_marker_is_left_and_logged_once(self) -> None:
        self.mark(b"not json")
        self.passes(gen=1)
        self.passes(gen=1)
        (line,) = self.logged
        self.assertIn(f"prod/{HOST}/moved.json is not a moved marker (not JSON", line)
        got = self.successResultOf(
            Deferred.fromCoroutine(self.store.get(moved.moved_key("prod", HOST)))
        )
        self.assertEqual(got.body, b"not json")  # evidence, never overwritten

    def test_an_unreadable_marker_fails_the_wake(self) -> None:
        # A marker whose bytes no longer match its ETag: the bucket refuses to read it.
        self.mark(MovedRecord("fi", 20).to_bytes())
        (path,) = (
            os.path.join(d, f)
            for d, _, files in os.walk(os.path.join(self.root, "bucket"))
            for f in files
            if "moved.json" in f
        )
        with open(path, "r+b") as f:
            f.write(b"[")
        why = self.refused(gen=1)
        self.assertEqual(why.reason, "bucket")
        self.assertIn("the moved marker", why.message)
        self.assertEqual(self.asked, [])

    def test_clear_deletes_the_marker_once(self) -> None:
        self.mark(MovedRecord("fi", 20).to_bytes())
        self.assertTrue(
            self.successResultOf(Deferred.fromCoroutine(moved.clear(self.store, "prod", HOST)))
        )
        self.assertFalse(
            self.successResultOf(Deferred.fromCoroutine(moved.clear(self.store, "prod", HOST)))
        )
        self.passes(gen=1)

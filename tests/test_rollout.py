"""The fleet rollout's state machine (lchat.release.rollout) over a real ``file:`` bucket, on a fake
clock: batches fall due in order, a failed box or a silent batch rolls the rollout back, finished
boxes revert, only one rollout runs at a time, and two writers never both land a step.

The promise across real routers and agents is in test_deploy_mesh (FleetRolloutTests).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.objstore.file import FileStore
from lchat.release import rollout, settings
from lchat.release.rollout import (
    PRESENCE_FRESH,
    BadRollout,
    Board,
    Presence,
    Report,
    Rollout,
    RolloutError,
    RolloutRunning,
    advance,
    batches_of,
    channel_target,
    duty,
)
from lchat.release.settings import SettingsError, parse_window
from tests.fakes import inline

A, B, C = "https://a.example.net", "https://b.example.net", "https://c.example.net"
EPOCH = 1_790_000_000.0
_T = TypeVar("_T")


class BoardTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="rollout")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.clock = Clock()
        self.clock.advance(EPOCH)
        os.makedirs(os.path.join(self.root, "bucket"))
        self.store = FileStore(self.clock, os.path.join(self.root, "bucket"), run_in_thread=inline)
        self.board = self.board_of()

    def board_of(self) -> Board:
        return Board(self.store, "fleet", self.clock.seconds)

    def done_(self, work: Coroutine[Any, Any, _T]) -> _T:
        return self.successResultOf(Deferred.fromCoroutine(work))

    def fail_with(self, work: Coroutine[Any, Any, object], error: type[Exception]) -> Exception:
        return self.failureResultOf(Deferred.fromCoroutine(work), error).value

    def report(self, r: Rollout, box: str, outcome: rollout.Outcome, *failed: str) -> None:
        self.done_(self.board.report(Report(r.id, r.version, box, outcome, failed, "1.0", 0.0)))

    def step(self) -> Rollout:
        current, _ = self.done_(self.board.step())
        assert current is not None
        return current


class StateMachineTests(BoardTestCase):
    def test_batches_fall_due_in_order_and_the_last_report_finishes_it(self) -> None:
        r = self.done_(self.board.start("2.0", [[A], [B, C]], A, batch_timeout=600))
        self.assertEqual((r.state, r.due), ("running", 0))
        self.assertEqual(duty(r, A, None), "deploy")
        self.assertIsNone(duty(r, B, None))  # not its batch yet
        self.assertEqual(self.step(), r)  # nothing reported: nothing changes
        self.report(r, A, "done")
        r = self.step()
        self.assertEqual((r.state, r.due), ("running", 1))
        self.assertEqual(duty(r, B, None), "deploy")
        self.assertIsNone(duty(r, A, self.done_(self.board.report_of(A))))  # done once only
        self.report(r, B, "done")
        self.assertEqual(self.step().due, 1)  # C still deploying
        self.report(r, C, "done")
        r = self.step()
        self.assertEqual(r.state, "done")
        _, reports = self.done_(self.board.step())
        self.assertEqual(
            rollout.describe(r, reports),
            [f"  batch 1: {A}: done", f"  batch 2: {B}: done", f"  batch 2: {C}: done"],
        )

    def test_a_failed_box_rolls_the_finished_ones_back_and_leaves_the_rest(self) -> None:
        r = self.done_(self.board.start("3.0", [[A], [B], [C]], A, batch_timeout=600))
        self.report(r, A, "done")
        r = self.step()
        self.report(r, B, "failed", "x.example.com")
        r = self.step()
        self.assertEqual(r.state, "rollback")
        self.assertIn(f"failed on {B}: x.example.com", r.reason)
        own = self.done_(self.board.report_of(A))
        self.assertEqual(duty(r, A, own), "revert")
        self.assertIsNone(duty(r, B, self.done_(self.board.report_of(B))))  # it undid itself
        self.assertIsNone(duty(r, C, None))  # never reached: untouched
        self.assertEqual(self.step().state, "rollback")  # A has not reverted yet
        self.report(r, A, "rolled_back")
        r = self.step()
        self.assertEqual(r.state, "failed")
        _, reports = self.done_(self.board.step())
        self.assertEqual(
            rollout.describe(r, reports),
            [
                f"  batch 1: {A}: rolled_back",
                f"  batch 2: {B}: failed (failed: x.example.com)",
                f"  batch 3: {C}: not reached",
            ],
        )

    def test_a_silent_batch_times_out_into_rollback_then_failed(self) -> None:
        r = self.done_(self.board.start("2.0", [[A], [B]], A, batch_timeout=600))
        self.report(r, A, "done")
        self.clock.advance(1)
        r = self.step()
        self.clock.advance(599)
        self.assertEqual(self.step().state, "running")
        self.clock.advance(1)
        r = self.step()
        self.assertEqual(r.state, "rollback")
        self.assertIn(f"no report within 600s from {B}", r.reason)
        self.clock.advance(600)  # A's agent is down too
        r = self.step()
        self.assertEqual(r.state, "failed")
        self.assertIn(f"not rolled back within 600s: {A}", r.reason)

    def test_a_report_on_an_earlier_rollout_counts_for_nothing(self) -> None:
        old = Rollout("old", "1.0", ((A,),), "done", 0, EPOCH, EPOCH, A)
        r = self.done_(self.board.start("2.0", [[A]], A))
        self.done_(self.board.report(Report(old.id, "1.0", A, "done")))
        self.assertEqual(duty(r, A, self.done_(self.board.report_of(A))), "deploy")
        self.assertEqual(self.step().state, "running")
        self.assertIsNone(advance(r, {A: Report(old.id, "1.0", A, "failed")}, EPOCH))

    def test_batches_put_the_canaries_first(self) -> None:
        self.assertEqual(batches_of([A, B, C], 2), [[A, B], [C]])
        self.assertEqual(batches_of([A, B, C], 1, first=[C]), [[C], [A], [B]])
        self.assertEqual(batches_of([A, B, C], 2, first=[B, C]), [[B, C], [A]])


class OneAtATimeTests(BoardTestCase):
    def test_a_second_rollout_is_refused_while_one_runs_and_allowed_after(self) -> None:
        r = self.done_(self.board.start("2.0", [[A]], A))
        error = self.fail_with(self.board.start("3.0", [[A]], B), RolloutRunning)
        self.assertIn(f"rollout {r.id} of 2.0 is running (started by {A}", str(error))
        self.assertIn("--resume", str(error))
        self.report(r, A, "done")
        self.assertEqual(self.step().state, "done")
        again = self.done_(self.board.start("3.0", [[A]], B))  # If-Match over the finished one
        self.assertEqual((again.version, again.state), ("3.0", "running"))

    def test_two_steps_over_one_read_land_once(self) -> None:
        r = self.done_(self.board.start("2.0", [[A], [B]], A))
        self.report(r, A, "done")
        _, etag = self.done_(self.board.read())
        assert etag is not None
        moved = advance(r, {A: Report(r.id, "2.0", A, "done")}, EPOCH)
        assert moved is not None
        landed = self.done_(self.board._replace(r, moved, etag))
        self.assertEqual(landed.due, 1)
        stale = evolve(r, state="rollback", reason="stale")  # a step over the old read
        self.assertEqual(self.done_(self.board._replace(r, stale, etag)).due, 1)
        self.assertEqual(self.step().state, "running")

    def test_abort_turns_a_running_rollout_to_rollback(self) -> None:
        self.fail_with(self.board.abort("by hand"), RolloutError)
        r = self.done_(self.board.start("2.0", [[A], [B]], A))
        self.report(r, A, "done")
        r = self.done_(self.board.abort(f"aborted by {B}"))
        self.assertEqual((r.state, r.reason), ("rollback", f"aborted by {B}"))
        self.assertEqual(duty(r, A, self.done_(self.board.report_of(A))), "revert")


class RecordTests(BoardTestCase):
    def test_a_damaged_record_is_an_error_naming_its_key(self) -> None:
        self.done_(self.store.put("fleet/release/rollout.json", b'{"state": "running"}'))
        error = self.fail_with(self.board.read(), BadRollout)
        self.assertIn("fleet/release/rollout.json is not a rollout record", str(error))

    def test_records_round_trip(self) -> None:
        r = Rollout("i", "2.0", ((A,), (B, C)), "rollback", 1, EPOCH, EPOCH + 1, A, 60.0, "why")
        self.assertEqual(Rollout.parse(r.to_bytes(), "k"), r)
        report = Report("i", "2.0", A, "failed", ("h.example.com",), None, EPOCH, "d")
        self.assertEqual(Report.parse(report.to_bytes(), "k"), report)
        with self.assertRaises(BadRollout):
            Report.parse(b'{"id": "i", "version": "2", "box": "b", "outcome": "meh"}', "k")


class ChannelTests(BoardTestCase):
    """Following a release channel: what to roll out, when, and over which boxes."""

    CHANNELS: ClassVar[dict[str, str]] = {"stable": "1.3.2", "canary": "1.4.0"}

    def test_only_a_newer_build_is_rolled_out(self) -> None:
        self.assertEqual(channel_target("canary", self.CHANNELS, "1.3.2", {}), "1.4.0")
        self.assertEqual(channel_target("canary", self.CHANNELS, None, {}), "1.4.0")
        self.assertIsNone(channel_target("canary", self.CHANNELS, "1.4.0", {}))  # there
        self.assertIsNone(channel_target("stable", self.CHANNELS, "1.4.0", {}))  # never down
        self.assertIsNone(channel_target("stable", {}, "1.0", {}))  # the channel names nothing
        self.assertIsNone(channel_target("stable", {"stable": "abc"}, "def", {}))  # no order
        released = {"abc": "2026-12-01T00:00:00Z", "def": "2026-11-01T00:00:00Z"}
        self.assertEqual(channel_target("stable", {"stable": "abc"}, "def", released), "abc")

    def test_the_window_is_utc_and_may_span_midnight(self) -> None:
        def at(hour: int, minute: int = 0) -> datetime.datetime:
            return datetime.datetime(2026, 12, 5, hour, minute, tzinfo=datetime.UTC)

        night = parse_window("03:00-05:00")
        self.assertEqual([night.holds(at(h)) for h in (2, 3, 4, 5)], [False, True, True, False])
        self.assertTrue(night.holds(at(4, 59)))
        paris = datetime.timezone(datetime.timedelta(hours=1))
        self.assertTrue(night.holds(datetime.datetime(2026, 12, 5, 4, 30, tzinfo=paris)))  # 03:30Z
        late = parse_window("23:30-00:30")
        self.assertEqual([late.holds(at(h, 0)) for h in (23, 0, 1)], [False, True, False])
        self.assertTrue(late.holds(at(23, 45)))
        for bad in ("3:00-5:00", "03:00-03:00", "24:00-01:00", "03:00"):
            with self.assertRaises(SettingsError) as e:
                parse_window(bad)
            self.assertIn("LCHAT_RELEASE_WINDOW", str(e.exception))

    def test_settings_read_the_channel_and_window(self) -> None:
        s = settings.read(
            {"LCHAT_RELEASE_CHANNEL": "canary", "LCHAT_RELEASE_WINDOW": "03:00-05:00"}, {}
        )
        self.assertEqual((s.channel, str(s.window)), ("canary", "03:00-05:00"))
        self.assertFalse(s.in_window(datetime.datetime(2026, 12, 5, 12, 0, tzinfo=datetime.UTC)))
        self.assertTrue(settings.read({}, {}).in_window(datetime.datetime.now(datetime.UTC)))
        self.assertEqual(settings.read({}, {}).channel, "")  # manual: today's behaviour
        with self.assertRaises(SettingsError) as e:
            settings.read({"LCHAT_RELEASE_CHANNEL": "beta"}, {})
        self.assertIn("LCHAT_RELEASE_CHANNEL='beta' must be stable or canary", str(e.exception))

    def announce(self, box: str, channel: str, default: str | None = "1.3.2") -> None:
        self.done_(self.board.announce(Presence(box, channel, default, self.clock.seconds())))

    def test_a_channel_rollout_takes_the_boxes_on_it_canaries_first(self) -> None:
        both = {"stable": "1.4.0", "canary": "1.4.0"}
        self.announce(A, "stable")
        self.announce(C, "canary")
        self.announce(B, "stable")
        self.clock.advance(PRESENCE_FRESH + 1)
        self.announce(A, "stable")
        self.announce(C, "canary")  # B has been silent too long: not counted in
        said = self.done_(self.board.follow(A, "stable", "1.4.0", both))
        self.assertIn("started rollout", said)
        r = self.step()
        self.assertEqual(
            (r.version, r.batches, r.by), ("1.4.0", ((C,), (A,)), f"channel stable ({A})")
        )
        # B comes back and joins the running rollout, as its last batch.
        said = self.done_(self.board.follow(B, "stable", "1.4.0", both))
        self.assertIn(f"joined rollout {r.id} of 1.4.0", said)
        self.assertEqual(self.step().batches, ((C,), (A,), (B,)))
        self.assertIn("in rollout", self.done_(self.board.follow(B, "stable", "1.4.0", both)))

    def test_a_canary_only_version_leaves_the_stable_boxes_alone(self) -> None:
        self.announce(A, "stable")
        self.announce(C, "canary")
        self.done_(self.board.follow(C, "canary", "1.4.0", self.CHANNELS))
        self.assertEqual(self.step().batches, ((C,),))
        # Another version runs: a follower of a channel naming something else waits.
        said = self.done_(self.board.follow(A, "stable", "1.3.3", {"stable": "1.3.3"}))
        self.assertIn("waiting: rollout", said)
        self.assertEqual(self.step().batches, ((C,),))

    def test_a_failed_version_is_not_retried_by_the_channel(self) -> None:
        self.announce(C, "canary")
        self.done_(self.board.follow(C, "canary", "1.4.0", self.CHANNELS))
        r = self.step()
        self.report(r, C, "failed", "x.example.com")
        self.assertEqual(self.step().state, "rollback")
        self.assertEqual(self.step().state, "failed")
        said = self.done_(self.board.follow(C, "canary", "1.4.0", self.CHANNELS))
        self.assertIn(f"rollout {r.id} of 1.4.0 failed", said)
        self.assertIn("not retried by the channel", said)
        current, _ = self.done_(self.board.read())
        self.assertEqual((current.id, current.state), (r.id, "failed"))  # type: ignore[union-attr]
        # A newer version on the channel goes ahead.
        said = self.done_(self.board.follow(C, "canary", "1.4.1", {"canary": "1.4.1"}))
        self.assertIn("started rollout", said)

"""The fleet rollout's state machine (lchat.release.rollout) over a real ``file:`` bucket, on a fake
clock: batches fall due in order, a failed box or a silent batch rolls the rollout back, finished
boxes revert, only one rollout runs at a time, and two writers never both land a step.

The promise across real routers and agents is in test_deploy_mesh (FleetRolloutTests).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Coroutine
from typing import Any, TypeVar

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from lchat.objstore.file import FileStore
from lchat.release import rollout
from lchat.release.rollout import (
    BadRollout,
    Board,
    Report,
    Rollout,
    RolloutError,
    RolloutRunning,
    advance,
    batches_of,
    duty,
)
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

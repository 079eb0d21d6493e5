"""lchat.deferutil: one result watched by many, one outcome handed to many."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from lchat.deferutil import fire, observe, relay, settled


class ObserveTests(SynchronousTestCase):
    def test_every_watcher_gets_the_result_and_it_stays_on_the_task(self) -> None:
        task: Deferred[int] = Deferred()
        watchers = [observe(task) for _ in range(3)]
        task.callback(7)
        self.assertEqual([self.successResultOf(w) for w in watchers], [7, 7, 7])
        self.assertEqual(self.successResultOf(task), 7)

    def test_a_watcher_that_gives_up_does_not_cancel_the_task(self) -> None:
        task: Deferred[int] = Deferred()
        gave_up = observe(task)
        gave_up.cancel()
        self.failureResultOf(gave_up, CancelledError)
        self.assertNoResult(task)
        task.callback(1)
        self.assertEqual(self.successResultOf(task), 1)

    def test_a_failure_handed_on_is_not_left_unhandled_on_the_task(self) -> None:
        task: Deferred[int] = Deferred()
        watcher = observe(task)
        task.errback(ValueError("no"))
        self.failureResultOf(watcher, ValueError)
        self.assertIsNone(self.successResultOf(task))


class SettledTests(SynchronousTestCase):
    def test_fires_none_whatever_the_task_did_and_leaves_its_result(self) -> None:
        task: Deferred[int] = Deferred()
        done = settled(task)
        task.errback(ValueError("no"))
        self.assertIsNone(self.successResultOf(done))
        self.failureResultOf(task, ValueError)


class FireTests(SynchronousTestCase):
    def test_one_outcome_for_every_waiter_not_fired_yet(self) -> None:
        waiters: list[Deferred[int]] = [Deferred() for _ in range(3)]
        waiters[1].cancel()  # gave up: skipped
        fire(waiters, 5)
        self.assertEqual(self.successResultOf(waiters[0]), 5)
        self.failureResultOf(waiters[1], CancelledError)
        self.assertEqual(self.successResultOf(waiters[2]), 5)
        failing: list[Deferred[int]] = [Deferred(), Deferred()]
        fire(failing, Failure(ValueError("no")))
        for d in failing:
            self.failureResultOf(d, ValueError)

    def test_relay_passes_a_failure_and_turns_a_result_into_none(self) -> None:
        ok: Deferred[None] = Deferred()
        relay("anything", ok)
        self.assertIsNone(self.successResultOf(ok))
        bad: Deferred[None] = Deferred()
        relay(Failure(ValueError("no")), bad)
        self.failureResultOf(bad, ValueError)
        relay(None, bad)  # fired already: left alone

"""lchat.cli.runner.run: the one way a CLI command runs async work, on a fresh reactor per call."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from lchat.cli import runner
from lchat.threads import thread_runner


async def nap(r: Any, seconds: float = 0.01) -> None:
    await deferLater(r, seconds, lambda: None)


class RunTests(SynchronousTestCase):
    def test_the_result_of_main_on_a_reactor_of_its_own(self) -> None:
        seen: list[Any] = []

        async def main(r: Any) -> str:
            seen.append(r)
            await nap(r)
            # Blocking work runs in that reactor's own pool and comes back to it.
            return str(await thread_runner(r)(lambda: "from a thread"))

        self.assertEqual(runner.run(main), "from a thread")
        self.assertIsNot(seen[0], global_reactor)
        self.assertFalse(seen[0].running)

    def test_runs_again_and_again_in_one_process(self) -> None:
        reactors = []

        async def main(r: Any) -> int:
            reactors.append(r)
            await nap(r)
            return len(reactors)

        self.assertEqual([runner.run(main, 5.0) for _ in range(3)], [1, 2, 3])
        self.assertEqual(len({id(r) for r in reactors}), 3)

    def test_a_budget_that_expires_cancels_main(self) -> None:
        cleaned: list[bool] = []

        async def forever(r: Any) -> None:
            try:
                await Deferred()
            finally:
                cleaned.append(True)  # its finally blocks run: stores closed, fences released

        started = time.monotonic()
        with self.assertRaises(TimeoutError) as caught:
            runner.run(forever, 0.2)
        self.assertLess(time.monotonic() - started, 2.0)
        self.assertEqual(str(caught.exception), "not finished within 0.2s")
        self.assertEqual(cleaned, [True])

    def test_without_a_budget_there_is_no_bound(self) -> None:
        async def slow(r: Any) -> str:
            await nap(r, 0.3)
            return "done"

        self.assertEqual(runner.run(slow), "done")

    def test_a_command_that_raises(self) -> None:
        async def broken(r: Any) -> None:
            await nap(r)
            raise ValueError("boom")

        with self.assertRaisesRegex(ValueError, "boom"):
            runner.run(broken, 5.0)

    def test_its_own_timeout_error_is_not_the_budget(self) -> None:
        """Only the budget is reported as the budget: a TimeoutError of main's own passes."""

        async def gave_up(r: Any) -> None:
            raise TimeoutError("the peer did not answer")

        with self.assertRaisesRegex(TimeoutError, "the peer did not answer"):
            runner.run(gave_up, 5.0)

    def test_an_interrupt_stops_it(self) -> None:
        """SIGINT and SIGTERM on the main thread stop the reactor (KeyboardInterrupt: ``lchat``
        says "interrupted"); the caller's own handlers are back afterwards."""
        for number in runner.STOP_SIGNALS:
            before = signal.getsignal(number)

            async def interrupted(r: Any, number: int = number) -> None:
                r.callLater(0.05, os.kill, os.getpid(), number)
                await Deferred()

            with self.assertRaises(KeyboardInterrupt):
                runner.run(interrupted, 5.0)
            self.assertIs(signal.getsignal(number), before)
            self.assertEqual(runner.run(lambda r: nap(r)), None)  # and it runs again after


class BesideTheGlobalReactorTests(TestCase):
    async def test_from_a_worker_thread_while_the_global_reactor_runs(self) -> None:
        """As tests call commands (trial's reactor running on the main thread): a reactor of the
        command's own in the calling thread, no signal handler taken off the main thread."""

        async def main(r: Any) -> tuple[str, bool]:
            await nap(r)
            return threading.current_thread().name, r is global_reactor

        def call() -> tuple[tuple[str, bool], str, bool]:
            handler = signal.getsignal(signal.SIGINT)
            result = runner.run(main, 5.0)
            return (
                result,
                threading.current_thread().name,
                signal.getsignal(signal.SIGINT) is handler,
            )

        (ran_in, was_global), caller, kept = await deferToThread(call)
        self.assertEqual(ran_in, caller)
        self.assertFalse(was_global)
        self.assertTrue(kept)

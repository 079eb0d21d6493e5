"""lchat.reactors: a whole reactor is checked, not assumed."""

from __future__ import annotations

from twisted.internet.pollreactor import PollReactor
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from lchat.reactors import installed, whole


class WholeTests(SynchronousTestCase):
    def test_a_real_reactor_is_whole(self) -> None:
        reactor = PollReactor()
        self.assertIs(whole(reactor), reactor)

    def test_the_installed_reactor_is_the_global_one(self) -> None:
        from twisted.internet import reactor

        self.assertIs(installed(), reactor)

    def test_a_partial_one_is_refused_naming_what_it_lacks(self) -> None:
        with self.assertRaises(TypeError) as raised:
            whole(MemoryReactorClock())
        self.assertIn("IReactorThreads, IReactorProcess", str(raised.exception))

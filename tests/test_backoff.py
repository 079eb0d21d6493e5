"""lchat.backoff: the one exponential backoff. The numbers each retrying place used before it
shared this helper are pinned here, with their old formulas side by side."""

from __future__ import annotations

import random

from twisted.trial.unittest import SynchronousTestCase

from lchat.backoff import Backoff


class BackoffTests(SynchronousTestCase):
    def test_doubles_from_the_first_delay_to_the_cap(self) -> None:
        wake = Backoff(1.0, 60.0)
        self.assertEqual([wake.delay(n) for n in range(0, 9)], [1, 1, 2, 4, 8, 16, 32, 60, 60])
        self.assertEqual(wake.delay(10**9), 60.0)  # a long outage never overflows
        self.assertEqual(Backoff(1.0, 1e308, factor=10.0).delay(500), 1e308)

    def test_after_is_the_next_delay_of_a_running_series(self) -> None:
        restart = Backoff(1.0, 8.0)
        self.assertEqual([restart.after(d) for d in (1, 2, 4, 8, 0.5)], [2, 4, 8, 8, 2])

    def test_refuses_what_is_not_a_backoff(self) -> None:
        for bad in (
            {"initial": 0.0, "cap": 1.0},
            {"initial": 2.0, "cap": 1.0},
            {"initial": 1.0, "cap": 2.0, "factor": 0.5},
            {"initial": 1.0, "cap": 2.0, "jitter": (1.0, 0.5)},
            {"initial": 1.0, "cap": 2.0, "jitter": (-0.1, 1.0)},
        ):
            with self.assertRaises(ValueError, msg=str(bad)):
                Backoff(**bad)

    def test_no_jitter_takes_no_randomness(self) -> None:
        class NoRandom:
            def uniform(self, a: float, b: float) -> float:
                raise AssertionError("no jitter was asked for")

        self.assertEqual(Backoff(1.0, 2.0).jittered(1.5, NoRandom()), 1.5)

    def test_equal_jitter_is_the_s3_and_dnsimple_formula(self) -> None:
        """``step / 2 + uniform(0, step / 2)``: what lchat.objstore.s3 and the DNSimple client
        computed by hand (0.1 s doubling to 2 s; 0.5 s to 5 s)."""
        for initial, cap in ((0.1, 2.0), (0.5, 5.0)):
            backoff = Backoff(initial, cap, jitter=(0.5, 1.0))
            for attempt in range(1, 12):
                step = min(cap, initial * 2 ** (attempt - 1))
                old = random.Random(attempt)
                new = random.Random(attempt)
                expected = step / 2 + old.uniform(0, step / 2)
                got = backoff.jittered(backoff.delay(attempt), new)
                self.assertAlmostEqual(got, expected, places=12)
                self.assertTrue(step / 2 <= got <= step)

    def test_scaled_jitter_is_the_issuer_and_dial_formula(self) -> None:
        """The issuer's ``delay * uniform(0.9, 1.1)`` and the proxy's dial retry's
        ``delay * uniform(0.8, 1.0)``."""
        for low, high in ((0.9, 1.1), (0.8, 1.0)):
            backoff = Backoff(0.05, 1.0, jitter=(low, high))
            for seed in range(20):
                expected = 0.4 * random.Random(seed).uniform(low, high)
                self.assertEqual(backoff.jittered(0.4, random.Random(seed)), expected)


class DelaysTests(SynchronousTestCase):
    def test_a_series_grows_to_the_cap_and_starts_again_after_a_reset(self) -> None:
        """The sidecar's retries (1 s doubling to 60 s), the lease keeper's, the flush retry's:
        ``delay = current; current = min(current * 2, cap)``."""
        delays = Backoff(1.0, 60.0).delays()
        self.assertEqual([delays.next() for _ in range(9)], [1, 2, 4, 8, 16, 32, 60, 60, 60])
        delays.reset()
        self.assertEqual(delays.next(), 1)

    def test_a_retry_after_is_honoured_up_to_the_cap_without_moving_the_series(self) -> None:
        delays = Backoff(1.0, 60.0).delays()
        self.assertEqual((delays.next(30), delays.next(), delays.next(1000)), (30, 2, 60))
        self.assertEqual(delays.next(0.5), 8)

    def test_the_old_hand_written_series_are_unchanged(self) -> None:
        def old(first: float, cap: float, n: int) -> list[float]:
            out, delay = [], first
            for _ in range(n):
                out.append(delay)
                delay = min(delay * 2, cap)
            return out

        for first, cap in ((0.02, 2.0), (0.05, 2.0), (0.5, 10.0), (2.0, 15.0), (0.05, 1.0)):
            delays = Backoff(first, cap).delays()
            self.assertEqual([delays.next() for _ in range(12)], old(first, cap, 12))

"""Exponential backoff, the one way the router spaces out its retries.

A :class:`Backoff` is a value: the first delay, the factor, the cap, and optionally a jitter
range. Code that retries keeps its own count and asks :meth:`Backoff.delay`, or keeps a
:class:`Delays` (the running delay of one series of retries); nothing here sleeps or schedules."""

from __future__ import annotations

import random
from typing import Protocol

from attrs import define, field, frozen


class Uniform(Protocol):
    """What jitter needs of a random source (:mod:`random` itself, or a seeded ``Random``)."""

    def uniform(self, a: float, b: float) -> float: ...


@frozen
class Backoff:
    """``initial``, then ``initial * factor``, ``initial * factor**2`` ... never above ``cap``.

    ``jitter = (low, high)``: :meth:`jittered` scales a delay by a random factor in that range,
    so that many boxes retrying the same thing spread out (``(0.5, 1.0)`` is "equal jitter":
    half the step fixed, half random). The default ``(1.0, 1.0)`` is no jitter."""

    initial: float
    cap: float
    factor: float = 2.0
    jitter: tuple[float, float] = (1.0, 1.0)

    def __attrs_post_init__(self) -> None:
        low, high = self.jitter
        if not 0 < self.initial <= self.cap or self.factor < 1 or not 0 <= low <= high:
            raise ValueError(f"not a backoff: {self!r}")

    def delay(self, attempt: int) -> float:
        """The delay before retry number ``attempt`` (1 for the first), without jitter."""
        if attempt <= 1:
            return self.initial
        # Capped before the power can overflow: attempt is unbounded on a long outage.
        steps = min(attempt - 1, 1024)
        try:
            return min(self.cap, self.initial * self.factor**steps)
        except OverflowError:
            return self.cap

    def after(self, delay: float) -> float:
        """The delay that follows ``delay``."""
        return min(self.cap, max(delay, self.initial) * self.factor)

    def jittered(self, delay: float, rng: Uniform = random) -> float:
        """``delay`` scaled by a random factor in :attr:`jitter` (``delay`` itself without)."""
        low, high = self.jitter
        if low == high == 1.0:
            return delay
        return delay * rng.uniform(low, high)

    def delays(self) -> Delays:
        """A fresh series of retries under this backoff."""
        return Delays(self)


@define
class Delays:
    """One series of retries: :meth:`next` is the delay before the next one (``initial``, then
    growing to the cap); :meth:`reset` after a success starts the series again."""

    backoff: Backoff
    _current: float = field(init=False, default=0.0)

    def __attrs_post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._current = self.backoff.initial

    def next(self, at_least: float | None = None) -> float:
        """The next delay, and the series moves on. ``at_least`` (a server's Retry-After) is
        honoured up to the cap, without changing the series."""
        delay = min(self.backoff.cap, max(self._current, at_least or 0.0))
        self._current = self.backoff.after(self._current)
        return delay

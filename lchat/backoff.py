"""Exponential backoff, the one way the router spaces out its retries.

A :class:`Backoff` is a value: the first delay, the factor, the cap. Code that retries keeps its own
count (or its last delay) and asks for the next one; nothing here sleeps or schedules."""

from __future__ import annotations

from attrs import frozen


@frozen
class Backoff:
    """``initial``, then ``initial * factor``, ``initial * factor**2`` ... never above ``cap``."""

    initial: float
    cap: float
    factor: float = 2.0

    def __attrs_post_init__(self) -> None:
        if not 0 < self.initial <= self.cap or self.factor < 1:
            raise ValueError(f"not a backoff: {self!r}")

    def delay(self, attempt: int) -> float:
        """The delay before retry number ``attempt`` (1 for the first)."""
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

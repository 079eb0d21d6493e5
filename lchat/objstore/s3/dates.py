"""The bucket's clock, estimated from the ``Date`` of its answers (leases expire by it).

A Date is truncated to the second, so no later than the bucket's time when it was sent; carried
forward on this box's monotonic clock (a step of the wall clock must not skew it) it bounds the
bucket's time from below. The latest such bound over the Dates of the last :data:`_WINDOW`
seconds, taken at different phases of the second, is much closer than one alone.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from lchat.objstore.s3.wire import http_date

FRESH = 1.0  # now() reuses the Date of a response younger than this (seconds)
# Short: each Date is carried forward on this box's monotonic clock, whose rate error it adds to
# (the lease's margin covers rate errors over dead_after, docs/lease.md).
_WINDOW = 2.0


class BucketDates:
    """The Dates the bucket sent lately, each with the local monotonic time it came."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._last: tuple[bytes, float] | None = None
        self._dates: list[tuple[bytes, float]] = []  # (Date, monotonic when it came), oldest first

    def note(self, date: bytes) -> None:
        at = self._monotonic()
        self._last = (date, at)
        dates = self._dates
        if dates and dates[-1][0] == date:
            return  # the same second again, later: the earlier bound is the tighter
        dates.append((date, at))
        while dates[0][1] < at - _WINDOW:
            del dates[0]

    def forget(self) -> None:
        """The store just failed us: a remembered Date must not make the clock look healthy."""
        self._last = None
        self._dates.clear()

    @property
    def fresh(self) -> bool:
        """A Date younger than :data:`FRESH` came."""
        return self._last is not None and self._monotonic() - self._last[1] < FRESH

    def now(self) -> datetime.datetime | None:
        """The bucket's clock, never ahead of it; None when no Date was usable. Only after a
        Date came (``fresh``, or an answer since)."""
        last = self._last
        assert last is not None
        at = self._monotonic()
        best: datetime.datetime | None = None
        # The last Date always counts (a Date seen again keeps its first arrival in the window,
        # which a slow answer can push out of it).
        for raw, came in [*self._dates, last]:
            date = http_date(raw)
            if date is None or (came < at - _WINDOW and (raw, came) != last):
                continue
            bound = date + datetime.timedelta(seconds=at - came)
            if best is None or bound > best:
                best = bound
        return best

"""One hibernating space as the activator tracks it, and the words of its life.

A :class:`Space` exists from the moment a wake begins until its stand-down has finished; "asleep"
is the absence of one. It is also the ticket the proxy holds for each request routed to it
(:class:`lchat.router.InFlight`): ``inflight`` counts what keeps it awake, ``requests`` (the plain
requests among them, not upgraded connections) what a graceful sleep waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from attrs import Factory, define, field, frozen
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.logger import Logger
from twisted.python.failure import Failure

from lchat.child import RunningChild
from lchat.deferutil import fire
from lchat.lease import HeldLease, LeaseKeeper
from lchat.registry import Route
from lchat.replica.replicator import Replicator

_log = Logger(namespace="lchat.activator")

State = Literal["waking", "awake", "stopping"]
STATES: tuple[State, ...] = ("waking", "awake", "stopping")
# The activator's states and the only moves between them ("asleep" is the absence of a Space):
# a wake that fails or is called off stands down from "waking"; a request queued while stopping
# wakes a new Space once the old one is asleep. Staying in a state is no move.
TRANSITIONS: Mapping[str, frozenset[str]] = {
    "asleep": frozenset({"waking"}),
    "waking": frozenset({"awake", "stopping"}),
    "awake": frozenset({"stopping"}),
    "stopping": frozenset({"asleep"}),
}


@frozen
class Budgets:
    """Seconds each step may take (docs/design.md §7, docs/hibernation.md "Budgets")."""

    wake: float = 300.0  # the whole wake
    queue: float = 30.0  # a request waiting for a wake
    ready: float = 30.0  # the space answering GET /api/version
    next_due: float = 10.0
    requests: float = 10.0  # a graceful sleep: requests already sent to the space finishing
    stop: float = 20.0  # SIGTERM -> SIGKILL
    flush: float = 60.0  # the final replication flush (retried within)
    release: float = 10.0
    sidecar_stop: float = 10.0
    lease_lost_stop: float = 2.0  # a space whose lease is gone: SIGKILL soon


class WakeFailed(Exception):
    """A wake did not happen. ``reason`` names it in metrics and picks the public 503 text
    (lchat.router.unavailable); ``message`` is for the log only."""

    def __init__(self, host: str, reason: str, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.host = host
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def of(cls, host: str, failure: Failure, wake_budget: float) -> WakeFailed:
        """What a wake that ended in ``failure`` failed of: itself if it is one, else
        ``timeout`` (the wake budget), ``cancelled`` (called off) or ``error`` (a bug: logged)."""
        why = failure.value
        if isinstance(why, WakeFailed):
            return why
        if failure.check(TimeoutError):
            return cls(host, "timeout", f"wake took longer than {wake_budget:g}s")
        if failure.check(CancelledError):
            return cls(host, "cancelled", "the wake was called off")
        _log.failure("activator: {host} wake failed", failure, host=host)
        return cls(host, "error", str(why))


@define(eq=False)
class Space:
    """What the activator holds for one host while anything runs (or stops) for it."""

    host: str
    route: Route
    state: State
    since: float  # when it entered ``state``
    socket: str
    db: str
    reason: str  # what woke it
    clock: Callable[[], float] = field(repr=False)
    waiters: list[Deferred[None]] = Factory(list)
    inflight: int = 0
    requests: int = 0  # of inflight, the plain requests (not upgrades): a graceful sleep waits
    requests_done: list[Deferred[None]] = Factory(list)  # fired when requests reaches 0
    last_active: float = 0.0
    lease: HeldLease | None = None
    keeper: LeaseKeeper | None = None
    replicator: Replicator | None = None
    child: RunningChild | None = None
    task: Deferred[Any] | None = None
    lost: str | None = None
    replicating: bool = False  # the replicator started (its flush means something)
    due_woken: int = 0  # the next_due this wake honoured (a due time is honoured once)
    wake_again: bool = False  # requests queued while stopping: wake once stopped
    # Read-only: its lease was lost because this (mesh) box is not alive any more, cut off from
    # bucket and peers; the space keeps answering reads, writes are refused, nothing is shipped,
    # until the box is alive again (then it stands down: docs/lease.md, "An isolated box").
    fenced: bool = False
    # The build directory the wake ran instead of the live link's, the space's build floor being
    # newer (lchat.hibernation.floor); its bot sidecar runs from there too. None: the link's.
    lifted_to: str | None = None
    # The bucket it woke from (lchat.hibernation.lifecycle.WakeBucket: this box's, or its home
    # region's); its lease, replica and final flush stay there until it is asleep. None: not yet.
    bucket: Any = None

    def move(self, to: State | Literal["asleep"]) -> None:
        """Enter ``to``; a move :data:`TRANSITIONS` does not list is a bug (AssertionError).
        "asleep" is the activator forgetting this Space: its state stays "stopping"."""
        if to != self.state and to not in TRANSITIONS[self.state]:
            raise AssertionError(f"{self.host}: no move from {self.state} to {to}")
        if to != "asleep":
            self.state = to

    # -- the proxy's ticket (lchat.router.InFlight) ----------------------------------------------

    def request_started(self, upgrade: bool) -> None:
        self.inflight += 1
        if not upgrade:
            self.requests += 1
        self.last_active = self.clock()

    def request_ended(self, upgrade: bool) -> None:
        self.inflight -= 1
        if not upgrade:
            self.requests -= 1
            if self.requests <= 0:
                done, self.requests_done = self.requests_done, []
                fire(done, None)  # (a wait whose budget ran out was cancelled: skipped)
        self.last_active = self.clock()

    async def requests_finished(self) -> None:
        """Returns once no plain request is in flight (at once if none is)."""
        if self.requests > 0:
            done: Deferred[None] = Deferred()
            self.requests_done.append(done)
            await done

    def describe(self, now: float) -> dict[str, Any]:
        """As ``GET /status`` shows it."""
        entry: dict[str, Any] = {
            "state": self.state,
            "for": round(now - self.since, 3),
            "reason": self.reason,
            "inflight": self.inflight,
            "idle": round(now - self.last_active, 3) if self.state == "awake" else None,
            "pid": self.child.pid if self.child is not None else None,
            "replication": self.route.replication,
        }
        if self.fenced:
            entry["read_only"] = "isolated"
        if self.bucket is not None and self.bucket.region:
            entry["bucket_region"] = self.bucket.region  # served from its home region's bucket
        if self.replicator is not None:
            entry["txid"] = self.replicator.txid
            # Seconds since the oldest commit not yet in the bucket (lchat fleet's LAG).
            entry["lag"] = round(self.replicator.lag(), 3)
        return entry

    def idle_for(self, now: float) -> float:
        """Seconds with nothing in flight (0 while anything is)."""
        return 0.0 if self.inflight > 0 else now - self.last_active


def sidecar_name(host: str) -> str:
    return f"{host}-bot"

"""This box's liveness on the mesh (docs/lease.md): may it write on its leases now?

It may from the first landed heartbeat until its *deadline*, the later of ``W1`` (its own landed
heartbeat) and, with a peer channel only, ``W2`` (its required peers' word), as
:mod:`lchat.mesh.witness` defines them. Peers may judge this box dead only after that. When the deadline passes, every space stands down
(the ``on_not_alive`` hooks), and the membership beats under a new epoch (``renew``): nothing of
the old one counts again. A timer keeps the deadline; a deadline found passed by whatever is
handled next (a freeze, a stalled loop) lapses too (:meth:`Liveness.missed`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from lchat.mesh.members import call_hooks, log
from lchat.mesh.witness import Witnesses

# This box stops writing on its leases at dead_after * (1 - LIVENESS_MARGIN) after its last
# successful beat was sent: a tenth of dead_after covers a monotonic clock running up to ~10 %
# slower than the bucket's (docs/lease.md, "The timing argument").
LIVENESS_MARGIN = 0.1
STAND_DOWNS = Counter(
    "lchat_mesh_stand_downs_total",
    "Times this box stood every space down because no heartbeat landed within dead_after - margin",
)
_LIVENESS = Counter(
    "lchat_mesh_liveness_changes_total",
    "What keeps this box alive, each time it changes: bucket (its own landed heartbeat), peers "
    "(its peers' word alone: the bucket is out of reach), none (it stood every space down)",
    ["via"],
)
for _via in ("bucket", "peers", "none"):
    _LIVENESS.labels(_via)


class Liveness:
    """The deadline of one box (the module docstring); its membership tells it what landed
    (:meth:`beat_landed`) and when the peers' word may have moved it (:meth:`recheck`)."""

    def __init__(
        self,
        reactor: IReactorTime,  # the deadline's timer
        monotonic: Callable[[], float],  # the clock the deadline is kept on
        url: str,
        dead_after: float,
        margin: float,  # dead_after * LIVENESS_MARGIN
        witnesses: Witnesses,
        *,
        witnessed: bool,  # with a peer channel: W2 counts
        epoch: Callable[[], str],  # the epoch the heartbeat beats under now
        renew: Callable[[], None],  # after a lapse: beat under a new epoch
    ) -> None:
        self._reactor = reactor
        self._monotonic = monotonic
        self._url = url
        self._dead_after = dead_after
        self.margin = margin
        self._witnesses = witnesses
        self._witnessed = witnessed
        self._epoch = epoch
        self._renew = renew
        self.landed: float | None = None  # when the last landed beat of this epoch was sent
        self._alive_until: float | None = None  # None: no beat has landed yet (or we left)
        self._timer: IDelayedCall | None = None
        self._not_alive = False  # the deadline passed (logged, hooks told) until a beat lands
        self.leaving = False  # the heartbeat is being deleted: nothing lands any more
        self.first_beat: Deferred[None] = Deferred()  # fired by the first landed beat
        self._on_not_alive: list[Callable[[], object]] = []
        self._on_alive: list[Callable[[], object]] = []
        self._by_peers = False  # alive on W2 alone (logged when it changes)

    def alive(self) -> bool:
        """True from the first landed beat until the deadline, while the heartbeat exists."""
        return self._alive_until is not None and self._monotonic() < self._alive_until

    def lapsed(self) -> bool:
        """A beat landed once, and this box is not alive now."""
        return self.first_beat.called and not self.alive()

    def on_own_beat(self, now: float) -> bool:
        """Is this box alive on W1, its own landed heartbeat, at ``now`` (monotonic)?"""
        return self.landed is not None and now < self.landed + self._dead_after - self.margin

    def on_alive(self, fn: Callable[[], object]) -> None:
        self._on_alive.append(fn)

    def on_not_alive(self, fn: Callable[[], object]) -> None:
        self._on_not_alive.append(fn)

    def leave(self) -> None:
        """The drain deletes the heartbeat: nothing is written on our leases from now on."""
        self.leaving = True
        self._alive_until = None
        if self._timer is not None and self._timer.active():
            self._timer.cancel()

    def beat_landed(self, sent: float, epoch: str) -> None:
        """A heartbeat sent at ``sent`` (monotonic) with the body of ``epoch`` landed in the
        bucket (our PUT, or a peer's relay of it): W1 runs until ``sent + dead_after - margin``,
        if that epoch is still ours and had not lapsed when this answer is handled."""
        if epoch != self._epoch() or self.leaving:
            return  # a beat of an epoch that lapsed since it was sent: it counts for nothing
        if self.missed():
            return
        if self.landed is None or sent > self.landed:
            self.landed = sent
        self.recheck()

    def _deadline(self) -> float | None:
        """W1 or W2, whichever is later (None: no beat of this epoch has landed yet)."""
        if self.landed is None:
            return None
        w1 = self.landed + self._dead_after - self.margin
        if not self._witnessed:
            return w1
        return max(w1, self._witnesses.holder_deadline(self.landed))

    def missed(self) -> bool:
        """Has our deadline passed unnoticed (a freeze, a stalled loop: its timer has not run
        yet)? Then whatever is being handled now counts for nothing: peers may have judged us
        dead meanwhile. Lapses now, and says so."""
        if self._alive_until is not None and self._monotonic() >= self._alive_until:
            self._lapse()
            return True
        return False

    def recheck(self) -> None:
        """Our deadline may have moved (a beat landed, a peer answered or was retired, a peer
        became required, our beats' word changed): re-arm its timer, or lapse if it is past."""
        now = self._monotonic()
        until = self._deadline()
        if until is None:
            return
        if until <= now:
            if self._alive_until is not None:
                self._lapse()
            return
        previous = self._alive_until
        self._alive_until = until
        if previous != until:
            if self._timer is not None and self._timer.active():
                self._timer.cancel()
            self._timer = self._reactor.callLater(until - now, self._deadline_passed)
        w1 = self.on_own_beat(now)
        if self._witnessed and w1 == self._by_peers:
            self._by_peers = not w1
            if not w1:
                _LIVENESS.labels("peers").inc()
                log.warn(
                    "mesh: no heartbeat of {url} has landed for {seconds:.1f}s: alive on its "
                    "peers' word ({peers}) for up to {left:.0f}s more; its spaces keep serving",
                    url=self._url,
                    seconds=now - (self.landed or now),
                    peers=", ".join(p.url for p in self._witnesses.required()) or "none",
                    left=until - now,
                )
            else:
                _LIVENESS.labels("bucket").inc()
                log.info("mesh: {url} is alive on its own heartbeat again", url=self._url)
        became = self._not_alive or not self.first_beat.called
        if self._not_alive:
            self._not_alive = False
            log.info(
                "mesh: heartbeat {url} landed again: this box takes leases again", url=self._url
            )
        if not self.first_beat.called:
            self.first_beat.callback(None)
        if became:
            call_hooks(self._on_alive, "alive hook")

    def _deadline_passed(self) -> None:
        self._timer = None
        if self._alive_until is None:
            return
        left = self._alive_until - self._monotonic()
        if left > 0:
            # (A timer that fired early by the reactor's clock: look again at the deadline. A
            # deadline that moved was re-armed by recheck, which cancelled this timer.)
            self._timer = self._reactor.callLater(max(0.01, left), self._deadline_passed)
            return
        self._lapse()  # the new epoch at once: every beat sent from now on carries its body

    def _lapse(self) -> None:
        """Our liveness lapsed: the stand-down (once), then a new epoch, alive from its own
        first landed beat: every lease of the old one stays lost (their keepers compare epochs),
        no beat of the old body counts again, a janitor's delete listed with the old body's ETag
        cannot remove a beat that counts, and every permission to judge a peer by its silence
        that this box held is void (the peer may have stopped counting on it)."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._alive_until = None
        self.landed = None
        if not self._not_alive:
            self._declare_not_alive()
        self._renew()

    def _declare_not_alive(self) -> None:
        self._not_alive = True
        STAND_DOWNS.inc()
        _LIVENESS.labels("none").inc()
        witnesses = self._witnesses
        silent = [p.url for p in witnesses.required() if not witnesses.knows_backlog(p)]
        if not self._witnessed:
            why = (
                f"no heartbeat of {self._url} has landed for "
                f"{self._dead_after - self.margin:.1f}s (dead after {self._dead_after:g}s on "
                "the bucket's clock)"
            )
        else:
            why = (
                f"isolated: no heartbeat of {self._url} lands in the bucket, and its peers "
                f"{', '.join(silent) or '(none)'} have not answered in time"
            )
        log.critical(
            "mesh: standing down: {why}: standing every space down now, before peers may "
            "judge this box dead and take them over; no lease is taken until a beat lands again",
            why=why,
            url=self._url,
            dead_after=self._dead_after,
        )
        call_hooks(self._on_not_alive, "stand-down hook")

"""Who may wake on this box besides the request: its capacity (``LCHAT_MAX_INSTANCES``,
docs/hibernation.md "Capacity") and the operator's holds (``lchat relocate``).

Invariants:

- Capacity: the always-on space processes (``resident``) plus the slots the hibernating spaces
  hold never exceed the limit because of a wake. Every space waking, awake or stopping holds a
  slot; a stopping one whose slot was handed to a waiting wake is counted once, for that wake. A
  wake at the limit takes the slot of a space already stopping, else sleeps the awake space idle
  longest with nothing in flight (never an always-on one), and spawns only once that stand-down
  is done; with neither, it is refused at once: 503 ``capacity`` with ``Retry-After``. A slot is
  handed on at most once.
- A hold keeps a host asleep on this box, whoever asks, until its deadline (at most an hour) or
  its release, so a crashed caller cannot keep a space down for long.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from prometheus_client import Counter, Gauge
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from lchat.deferutil import settled
from lchat.hibernation.space import Space, WakeFailed

_log = Logger(namespace="lchat.activator")

_capacity = Gauge(
    "lchat_capacity_instances",
    "Resident space processes against LCHAT_MAX_INSTANCES by kind: always_on, hibernating (the "
    "slots hibernating spaces hold), max (the limit; 0 = none)",
    ["kind"],
)
_holds_total = Counter(
    "lchat_holds_total",
    "Operator holds on a space's wakes (lchat relocate) by event: held, released, expired",
    ["event"],
)
for _event in ("held", "released", "expired"):
    _holds_total.labels(_event)
_evictions = Counter(
    "lchat_capacity_evictions_total",
    "Awake hibernating spaces slept to make room for another's wake (LCHAT_MAX_INSTANCES)",
)

# A wake refused at capacity (everything resident busy): the client asks again this much later;
# requests usually end within seconds, and then the longest-idle space can be slept.
CAPACITY_RETRY = 5.0
HOLD_RETRY_AFTER = 5.0  # a held space's Retry-After (a relocation usually ends within seconds)
CAPACITY_LOG_EVERY = 10.0  # seconds between "503: nothing can be slept" lines (a storm is one)


class Holds:
    """The operator's holds: host -> (no wake until, why)."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._holds: dict[str, tuple[float, str]] = {}

    def hold(self, host: str, seconds: float, why: str) -> None:
        """No wake of ``host`` for ``seconds`` (clamped to 0 .. 3600)."""
        seconds = max(0.0, min(seconds, 3600.0))
        self._holds[host] = (self._clock.seconds() + seconds, why)
        _holds_total.labels("held").inc()
        _log.info(
            "activator: {host} held asleep for up to {seconds:g}s ({why})",
            host=host,
            seconds=seconds,
            why=why,
        )

    def release(self, host: str) -> bool:
        """End ``host``'s hold; whether there was one (a hold past its deadline had already
        ended: counted ``expired``, not released)."""
        held = self._holds.pop(host, None)
        if held is None:
            return False
        if held[0] <= self._clock.seconds():
            _holds_total.labels("expired").inc()
            return False
        _holds_total.labels("released").inc()
        _log.info("activator: {host} hold released ({why})", host=host, why=held[1])
        return True

    def held_asleep(self) -> dict[str, float]:
        """The hosts held now and the seconds each hold has left."""
        now = self._clock.seconds()
        return {h: round(until - now, 1) for h, (until, _) in self._holds.items() if until > now}

    def refusal(self, host: str) -> WakeFailed | None:
        """Why ``host`` may not wake now (503 ``held``), or None; a hold past its deadline ends
        here (counted ``expired``). Costs no bucket call."""
        if host not in self._holds:
            return None
        until, why = self._holds[host]
        now = self._clock.seconds()
        if now < until:
            return WakeFailed(host, "held", why, min(until - now, HOLD_RETRY_AFTER))
        del self._holds[host]
        _holds_total.labels("expired").inc()
        return None


class Capacity:
    """The slots of ``LCHAT_MAX_INSTANCES`` (see the module docstring). ``spaces`` is the
    activator's own map, read as it is at each call; ``sleep`` its graceful sleep."""

    def __init__(
        self,
        clock: IReactorTime,
        spaces: Mapping[str, Space],
        sleep: Callable[[str, str], Deferred[None]],
        *,
        resident: Callable[[], int] | None = None,
        max_instances: int = 0,
    ) -> None:
        self._clock = clock
        self._spaces = spaces
        self._sleep = sleep
        self._resident = resident if resident is not None else lambda: 0
        self._max = max_instances
        # A stopping space -> the waiting wake its slot was handed to.
        self._handed_on: dict[Space, Space] = {}
        self._refused_since_log = 0  # capacity refusals not logged yet (one line per storm)
        self._refusal_logged = float("-inf")

    def start(self) -> None:
        """Publish the gauges, read at each scrape: the always-on count changes without telling
        the activator."""
        _capacity.labels("always_on").set_function(lambda: self._resident())
        _capacity.labels("hibernating").set_function(self.slots_held)
        _capacity.labels("max").set(self._max)

    def slots_held(self) -> int:
        """The slots hibernating spaces hold: every one waking, awake or stopping, a stopping
        one whose slot was handed to a waiting wake counted once."""
        return len(self._spaces) - len(self._handed_on)

    def full(self) -> bool:
        """Would one more space process exceed the limit?"""
        if self._max <= 0:
            return False
        held = self.slots_held()
        return held >= self._max or held + self._resident() >= self._max

    def victim(self) -> Space | None:
        """Whose slot a wake at capacity takes: a space already stopping (free soon and at no
        cost; not one whose own queued requests will wake it again), the one stopping longest;
        else the awake space idle longest with nothing in flight. Never a slot already handed
        on, never an always-on space (the activator does not run those)."""
        stopping = [
            s
            for s in self._spaces.values()
            if s.state == "stopping" and s not in self._handed_on and not s.wake_again
        ]
        if stopping:
            return min(stopping, key=lambda s: s.since)
        idle = [s for s in self._spaces.values() if s.state == "awake" and s.inflight == 0]
        return min(idle, key=lambda s: s.last_active, default=None)

    def hand_on(self, victim: Space, space: Space) -> Deferred[None]:
        """Give ``victim``'s slot to ``space``'s wake (before the sleep starts: a stand-down
        that ends at once must find it) and sleep ``victim`` unless it is stopping already;
        fires once its stand-down is done and its process gone."""
        self._handed_on[victim] = space
        resident = self._resident() + self.slots_held()
        if victim.state == "stopping":
            _log.info(
                "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}): "
                "{host} waits for {victim} to finish sleeping",
                resident=resident,
                limit=self._max,
                host=space.host,
                victim=victim.host,
            )
            return settled(victim.task) if victim.task is not None else succeed(None)
        idle = self._clock.seconds() - victim.last_active
        _evictions.inc()
        _log.info(
            "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}): "
            "sleeping {victim} (idle {idle}) to wake {host}",
            resident=resident,
            limit=self._max,
            victim=victim.host,
            idle=_span(idle),
            host=space.host,
        )
        return self._sleep(victim.host, "capacity")

    def stood_down(self, space: Space) -> None:
        """``space`` is gone: its slot is free now (or the wake it was handed to holds it); and a
        waiting wake that ends before the space it waits for gives that space its slot back."""
        self._handed_on.pop(space, None)
        for victim in [v for v, taker in self._handed_on.items() if taker is space]:
            del self._handed_on[victim]

    async def when_freed(
        self, freed: Deferred[None], steps: Coroutine[Any, Any, dict[str, float]]
    ) -> dict[str, float]:
        """A wake's steps, once the slot it was handed is free (within the wake budget: the
        task's timeout covers the wait); the wait is its ``capacity`` phase."""
        started = self._clock.seconds()
        try:
            await freed
        except BaseException:
            steps.close()  # never started: no "coroutine was never awaited" warning
            raise
        waited = self._clock.seconds() - started
        timings: dict[str, float] = await steps
        timings["capacity"] = waited
        return timings

    def refusal(self, host: str) -> WakeFailed:
        """Nothing can be slept: 503 ``capacity`` with ``Retry-After``; logged once per
        CAPACITY_LOG_EVERY with how many were refused meanwhile."""
        now = self._clock.seconds()
        self._refused_since_log += 1
        if now - self._refusal_logged >= CAPACITY_LOG_EVERY:
            states = [s.state for s in self._spaces.values()]
            _log.warn(
                "activator: at capacity ({resident} resident, LCHAT_MAX_INSTANCES={limit}: "
                "{always_on} always-on, {awake} awake and busy, {waking} waking, {stopping} "
                "stopping): {host} answered 503: nothing can be slept ({refused} refused since "
                "the last such line); raise LCHAT_MAX_INSTANCES if this box has room",
                resident=self._resident() + self.slots_held(),
                limit=self._max,
                always_on=self._resident(),
                awake=states.count("awake"),
                waking=states.count("waking"),
                stopping=states.count("stopping"),
                host=host,
                refused=self._refused_since_log,
            )
            self._refusal_logged = now
            self._refused_since_log = 0
        return WakeFailed(
            host,
            "capacity",
            f"this box is at capacity (LCHAT_MAX_INSTANCES={self._max}) and every resident "
            f"space is busy",
            CAPACITY_RETRY,
        )


def _span(seconds: float) -> str:
    """``42s``, ``12m``, ``3h05m``: an idle time as an operator reads it."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"

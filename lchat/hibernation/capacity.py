"""Who may wake on this box besides the request: its capacity (memory, and the optional
``LCHAT_MAX_AWAKE``; docs/hibernation.md "Capacity") and the operator's holds (``lchat relocate``).

Invariants:

- Memory is the limit: a wake is admitted while the box's available memory (``MemAvailable``, or
  less when the router's cgroup sets a limit) minus the reserve (``LCHAT_MEMORY_RESERVE``) minus
  the reservations still holds one per-space figure. The per-space figure is the larger of
  ``LCHAT_SPACE_MEMORY`` and the running average of the awake spaces' measured PSS.
- Every hibernating space waking, awake or stopping (until its process is gone) reserves what it
  may still grow into: the figure less its PSS (the last sample; for one waking, or awake and
  never sampled, read now). So its memory is counted once, it counts for at least the figure in
  all, and wakes arriving together never count the same free memory twice. A wake waiting for
  its victim's exit reserves nothing meanwhile: the victim's memory is its room.
- ``LCHAT_MAX_AWAKE`` (0: none) caps the slots hibernating spaces hold: every space waking, awake
  or stopping holds a slot; a stopping one whose slot was handed to a waiting wake is counted
  once, for that wake. Always-on processes (``LCHAT_MAX_INSTANCES``) never count against either.
- A wake short of room (memory or a slot) takes the place of a space already stopping, else
  sleeps the awake space idle longest with nothing in flight (never an always-on one), and spawns
  only once that stand-down is done and memory, measured again, holds it (else the next victim);
  with no victim, it is refused at once: 503 ``capacity`` with ``Retry-After``, naming what is
  short. A victim is handed on at most once.
- A hold keeps a host asleep on this box, whoever asks, until its deadline (at most an hour) or
  its release, so a crashed caller cannot keep a space down for long.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from attrs import frozen
from prometheus_client import Counter, Gauge
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from lchat.deferutil import settled
from lchat.hibernation.space import Space, WakeFailed

_log = Logger(namespace="lchat.activator")

_capacity = Gauge(
    "lchat_capacity_instances",
    "Space processes by kind: always_on (running), hibernating (the slots hibernating spaces "
    "hold), max (LCHAT_MAX_INSTANCES: the always-on cap), max_awake (LCHAT_MAX_AWAKE); 0 = none",
    ["kind"],
)
_memory = Gauge(
    "lchat_capacity_memory_bytes",
    "Memory a wake is admitted by, by kind: available (MemAvailable, or the cgroup's room if "
    "less), reserve (LCHAT_MEMORY_RESERVE), per_space (the figure a wake needs)",
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
    "Awake hibernating spaces slept to make room for another's wake, by reason: memory (the "
    "box's available memory), max_awake (LCHAT_MAX_AWAKE)",
    ["reason"],
)
for _reason in ("memory", "max_awake"):
    _evictions.labels(_reason)

# A wake refused at capacity (everything resident busy): the client asks again this much later;
# requests usually end within seconds, and then the longest-idle space can be slept.
CAPACITY_RETRY = 5.0
HOLD_RETRY_AFTER = 5.0  # a held space's Retry-After (a relocation usually ends within seconds)
CAPACITY_LOG_EVERY = 10.0  # seconds between "503: nothing can be slept" lines (a storm is one)

MIB = 1 << 20
SPACE_MEMORY = 32 * MIB  # LCHAT_SPACE_MEMORY's default: a reference space's PSS, rounded up
RESERVE_FLOOR = 512 * MIB  # LCHAT_MEMORY_RESERVE's default: this, or 5 % of the total if more
RESERVE_SHARE = 0.05
PSS_WEIGHT = 0.2  # each PSS sample's weight in the running average (older ones decay)
# Spaces measured per sweep at most: reading smaps_rollup walks a process's mappings (~0.2 ms),
# so a box with a thousand awake spaces spreads them over sweeps; unmeasured ones go first.
MEASURE_BATCH = 64
MEASURE_EVERY = 5.0  # seconds between those readings (the idle sweep's default pace)


@frozen
class MemoryReaders:
    """Where memory figures come from (the seams tests replace; :data:`PROC` reads the kernel).
    All in bytes."""

    meminfo: Callable[[], Mapping[str, int]]  # /proc/meminfo: MemTotal, MemAvailable at least
    cgroup: Callable[[], tuple[int, int] | None]  # (memory.max, memory.current); None: no limit
    pss: Callable[[int], int | None]  # a process's proportional set size; None: gone


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal: 24576000 kB`` -> ``{"MemTotal": 25165824000}``)."""
    out = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def cgroup_reader(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> Callable[[], tuple[int, int] | None]:
    """A reader of this process's cgroup (v2) memory limit and use, found once: None when
    there is no v2 cgroup, its files cannot be read, or ``memory.max`` is ``max``."""
    directory = None
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            for line in f:
                if line.startswith("0::"):
                    directory = os.path.join(root, line[3:].strip().lstrip("/"))
    except OSError:
        pass

    def read() -> tuple[int, int] | None:
        if directory is None:
            return None
        try:
            with open(os.path.join(directory, "memory.max"), encoding="ascii") as f:
                limit = f.read().strip()
            if not limit.isdigit():
                return None  # "max": no limit
            with open(os.path.join(directory, "memory.current"), encoding="ascii") as f:
                return int(limit), int(f.read().strip())
        except (OSError, ValueError):
            return None

    return read


def read_pss(pid: int) -> int | None:
    """``pid``'s PSS from ``/proc/<pid>/smaps_rollup`` in bytes; None if it is gone (or not
    readable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def proc_readers() -> MemoryReaders:
    """The kernel's figures for this process (its cgroup found now)."""
    return MemoryReaders(read_meminfo, cgroup_reader(), read_pss)


class Memory:
    """The box's memory as a wake sees it (the module docstring's first invariant): what is
    available, the reserve, and what one space needs (``floor`` or the measured average)."""

    def __init__(
        self, readers: MemoryReaders, *, floor: int = SPACE_MEMORY, reserve: int | None = None
    ) -> None:
        """``reserve``: LCHAT_MEMORY_RESERVE in bytes; None: max(512 MiB, 5 % of the total)."""
        self._readers = readers
        self.floor = floor
        self._reserve = reserve
        self.average: float | None = None  # of the measured PSS samples (None: none yet)

    def available(self) -> int:
        """``MemAvailable``, or the cgroup's ``memory.max - memory.current`` if smaller."""
        free = self._readers.meminfo().get("MemAvailable", 0)
        cgroup = self._readers.cgroup()
        if cgroup is not None:
            free = min(free, max(0, cgroup[0] - cgroup[1]))
        return free

    def total(self) -> int:
        """``MemTotal``, or the cgroup's ``memory.max`` if smaller."""
        total = self._readers.meminfo().get("MemTotal", 0)
        cgroup = self._readers.cgroup()
        return min(total, cgroup[0]) if cgroup is not None else total

    def reserve(self) -> int:
        if self._reserve is not None:
            return self._reserve
        return max(RESERVE_FLOOR, int(self.total() * RESERVE_SHARE))

    def per_space(self) -> int:
        """What a wake needs: the floor, or the measured average if more."""
        return max(self.floor, round(self.average or 0))

    def pss(self, pid: int) -> int | None:
        """``pid``'s PSS now (not folded into the average: a process still starting)."""
        return self._readers.pss(pid)

    def measure(self, pid: int) -> int | None:
        """Fold ``pid``'s PSS into the average; returns it (None: it could not be read)."""
        pss = self._readers.pss(pid)
        if pss is None:
            return None
        self.average = (
            pss if self.average is None else self.average + PSS_WEIGHT * (pss - self.average)
        )
        return pss


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
    """Room for a wake (see the module docstring). ``spaces`` is the activator's own map, read as
    it is at each call; ``sleep`` its graceful sleep; ``resident`` counts the always-on processes
    (for the gauges and the status only: they never block a wake)."""

    def __init__(
        self,
        clock: IReactorTime,
        spaces: Mapping[str, Space],
        sleep: Callable[[str, str], Deferred[None]],
        *,
        resident: Callable[[], int] | None = None,
        max_instances: int = 0,
        max_awake: int = 0,
        memory: Memory | None = None,
    ) -> None:
        """``max_instances``: LCHAT_MAX_INSTANCES, published only (add-instance enforces it);
        ``max_awake``: LCHAT_MAX_AWAKE (0: none); ``memory``: None admits by no memory figure
        (a box without /proc, and tests of other things)."""
        self._clock = clock
        self._spaces = spaces
        self._sleep = sleep
        self._resident = resident if resident is not None else lambda: 0
        self._max_instances = max_instances
        self._max = max_awake
        self.memory = memory
        # A stopping space -> the waiting wake its slot was handed to.
        self._handed_on: dict[Space, Space] = {}
        # An awake space -> (when its PSS was last read, that PSS); absent: never read.
        self._measured: dict[Space, tuple[float, int]] = {}
        self._refused_since_log = 0  # capacity refusals not logged yet (one line per storm)
        self._refusal_logged = float("-inf")
        self._unreadable_said = False  # a space's PSS could not be read (said once)
        self._sampler = LoopingCall(self.measure)
        self._sampler.clock = clock

    def start(self, measure_every: float = MEASURE_EVERY) -> None:
        """Publish the gauges, read at each scrape (the always-on count changes without telling
        the activator); with memory on, measure the awake spaces every ``measure_every``
        seconds."""
        _capacity.labels("always_on").set_function(lambda: self._resident())
        _capacity.labels("hibernating").set_function(self.slots_held)
        _capacity.labels("max").set(self._max_instances)
        _capacity.labels("max_awake").set(self._max)
        memory = self.memory
        if memory is not None:
            _memory.labels("available").set_function(memory.available)
            _memory.labels("reserve").set_function(memory.reserve)
            _memory.labels("per_space").set_function(memory.per_space)
            self._sampler.start(measure_every, now=False).addErrback(
                lambda f: _log.failure("activator: measuring awake spaces' memory stopped", f)
            )

    def stop(self) -> None:
        if self._sampler.running:
            self._sampler.stop()

    def slots_held(self) -> int:
        """The slots hibernating spaces hold: every one waking, awake or stopping, a stopping
        one whose slot was handed to a waiting wake counted once."""
        return len(self._spaces) - len(self._handed_on)

    def reserved(self, besides: Space | None = None) -> int:
        """Bytes reserved by the spaces waking (not waiting for a victim's exit: its memory is
        theirs), awake and stopping (until the process is gone): each the per-space figure less
        its PSS (``besides`` left out: a
        waiting wake re-checking its own room). O(awake); reads /proc only for the spaces not
        sampled yet."""
        memory = self.memory
        assert memory is not None
        per_space = memory.per_space()
        waiting = set(self._handed_on.values())
        total = 0
        for s in self._spaces.values():
            if s is besides or s in waiting:
                continue
            sampled = self._measured.get(s)
            pss = sampled[1] if sampled is not None else None
            if pss is None and s.child is not None and s.child.pid is not None:
                pss = memory.pss(s.child.pid)
            total += per_space if pss is None else max(0, per_space - pss)
        return total

    def headroom(self, besides: Space | None = None) -> int:
        """Bytes a new space may take now: available - reserve - the reservations."""
        memory = self.memory
        assert memory is not None
        return memory.available() - memory.reserve() - self.reserved(besides)

    def short(self, besides: Space | None = None) -> str | None:
        """What one more space lacks: ``"max_awake"`` (every LCHAT_MAX_AWAKE slot held),
        ``"memory"``, or None (room)."""
        if self._max > 0 and besides is None and self.slots_held() >= self._max:
            return "max_awake"
        if self.memory is not None and self.headroom(besides) < self.memory.per_space():
            return "memory"
        return None

    def victim(self) -> Space | None:
        """Whose place a wake short of room takes: a space already stopping (free soon and at no
        cost; not one whose own queued requests will wake it again), the one stopping longest;
        else the awake space idle longest with nothing in flight. Never one already handed on,
        never an always-on space (the activator does not run those)."""
        stopping = [
            s
            for s in self._spaces.values()
            if s.state == "stopping" and s not in self._handed_on and not s.wake_again
        ]
        if stopping:
            return min(stopping, key=lambda s: s.since)
        idle = [s for s in self._spaces.values() if s.state == "awake" and s.inflight == 0]
        return min(idle, key=lambda s: s.last_active, default=None)

    def _why(self, short: str) -> str:
        """An operator's reading of what is short, for the log lines."""
        if short == "max_awake":
            return f"at LCHAT_MAX_AWAKE={self._max} ({self.slots_held()} held)"
        memory = self.memory
        assert memory is not None
        return (
            f"memory (available {_size(memory.available())}, reserve {_size(memory.reserve())}, "
            f"~{_size(memory.per_space())} a space, {_size(self.reserved())} reserved)"
        )

    def hand_on(self, victim: Space, space: Space, short: str) -> Deferred[None]:
        """Give ``victim``'s place to ``space``'s wake (before the sleep starts: a stand-down
        that ends at once must find it) and sleep ``victim`` unless it is stopping already;
        fires once its stand-down is done and its process gone. ``short``: what ``space``
        lacked (``memory`` or ``max_awake``)."""
        self._handed_on[victim] = space
        if victim.state == "stopping":
            _log.info(
                "activator: {why}: {host} waits for {victim} to finish sleeping",
                why=self._why(short),
                host=space.host,
                victim=victim.host,
            )
            return settled(victim.task) if victim.task is not None else succeed(None)
        idle = self._clock.seconds() - victim.last_active
        _evictions.labels(short).inc()
        _log.info(
            "activator: {why}: sleeping {victim} (idle {idle}) to wake {host}",
            why=self._why(short),
            victim=victim.host,
            idle=_span(idle),
            host=space.host,
        )
        return self._sleep(victim.host, "capacity")

    def stood_down(self, space: Space) -> None:
        """``space`` is gone: its slot is free now (or the wake it was handed to holds it); and a
        waiting wake that ends before the space it waits for gives that space its slot back."""
        self._handed_on.pop(space, None)
        self._measured.pop(space, None)
        for victim in [v for v, taker in self._handed_on.items() if taker is space]:
            del self._handed_on[victim]

    def awake(self, space: Space) -> None:
        """``space`` has just turned awake: its memory is read now (its reservation shrinks to
        the figure less that; if it cannot be read, the next sweep's reading does)."""
        memory = self.memory
        child = space.child
        if memory is not None and child is not None and child.pid is not None:
            pss = memory.measure(child.pid)
            if pss is not None:
                self._measured[space] = (self._clock.seconds(), pss)
            elif not self._unreadable_said:
                # Its process runs (it just answered): /proc/<pid>/smaps_rollup is closed to the
                # router (another uid, without CAP_SYS_PTRACE). Each such space then counts its
                # whole figure on top of the memory it uses: the box holds fewer than it could.
                self._unreadable_said = True
                _log.warn(
                    "activator: {host}: /proc/{pid}/smaps_rollup cannot be read: awake spaces "
                    "count LCHAT_SPACE_MEMORY on top of what they use (run the router as root, "
                    "or give it CAP_SYS_PTRACE, for their measured memory)",
                    host=space.host,
                    pid=child.pid,
                )

    def measure(self) -> int:
        """Read the PSS of awake spaces (never measured first, then the longest unmeasured; at
        most MEASURE_BATCH): each sets its reservation and feeds the per-space figure. Returns
        how many were read. Every MEASURE_EVERY seconds (:meth:`start`)."""
        memory = self.memory
        if memory is None:
            return 0
        awake = [
            s
            for s in self._spaces.values()
            if s.state == "awake" and s.child is not None and s.child.pid is not None
        ]
        awake.sort(key=lambda s: self._measured.get(s, (float("-inf"), 0))[0])
        now = self._clock.seconds()
        read = 0
        for space in awake[:MEASURE_BATCH]:
            assert space.child is not None and space.child.pid is not None
            pss = memory.measure(space.child.pid)
            if pss is not None:
                self._measured[space] = (now, pss)
                read += 1
        return read

    async def when_freed(
        self, freed: Deferred[None], space: Space, steps: Coroutine[Any, Any, dict[str, float]]
    ) -> dict[str, float]:
        """``space``'s wake steps, once the place it was handed is free and memory, read again,
        holds it (else the next victim's, the same way; with none, 503 ``capacity``): all within
        the wake budget (the task's timeout covers the wait); the wait is its ``capacity``
        phase."""
        started = self._clock.seconds()
        try:
            await freed
            while self.short(besides=space) is not None:
                victim = self.victim()
                if victim is None:
                    raise self.refusal(space.host, "memory")
                await self.hand_on(victim, space, "memory")
        except BaseException:
            steps.close()  # never started: no "coroutine was never awaited" warning
            raise
        waited = self._clock.seconds() - started
        timings: dict[str, float] = await steps
        timings["capacity"] = waited
        return timings

    def status(self) -> dict[str, int]:
        """``GET /status``'s capacity figures from here: ``max_awake``, and with memory on
        ``mem_available``, ``mem_reserve``, ``per_space`` (bytes) and ``awake_estimate`` (the
        hibernating spaces this box holds now plus the ones its headroom admits)."""
        out = {"max_awake": self._max}
        memory = self.memory
        if memory is not None:
            per_space = memory.per_space()
            out |= {
                "mem_available": memory.available(),
                "mem_reserve": memory.reserve(),
                "per_space": per_space,
                "awake_estimate": self.slots_held() + max(0, self.headroom() // per_space),
            }
        return out

    def refusal(self, host: str, short: str) -> WakeFailed:
        """Nothing can be slept: 503 ``capacity`` with ``Retry-After``, naming what is
        ``short``; logged once per CAPACITY_LOG_EVERY with how many were refused meanwhile."""
        now = self._clock.seconds()
        self._refused_since_log += 1
        fix = (
            "raise LCHAT_MAX_AWAKE if this box has room"
            if short == "max_awake"
            else "add memory or boxes, or lower LCHAT_SPACE_MEMORY if spaces need less"
        )
        if now - self._refusal_logged >= CAPACITY_LOG_EVERY:
            states = [s.state for s in self._spaces.values()]
            _log.warn(
                "activator: {why}: {awake} awake and busy, {waking} waking, {stopping} "
                "stopping, {always_on} always-on: {host} answered 503: nothing can be slept "
                "({refused} refused since the last such line); {fix}",
                why=self._why(short),
                always_on=self._resident(),
                awake=states.count("awake"),
                waking=states.count("waking"),
                stopping=states.count("stopping"),
                host=host,
                refused=self._refused_since_log,
                fix=fix,
            )
            self._refusal_logged = now
            self._refused_since_log = 0
        lacking = (
            f"every LCHAT_MAX_AWAKE={self._max} slot is held"
            if short == "max_awake"
            else "its memory is taken"
        )
        return WakeFailed(
            host,
            "capacity",
            f"this box is at capacity ({lacking}) and every awake space is busy",
            CAPACITY_RETRY,
        )


def _size(n: float) -> str:
    """``512 MiB``, ``1.1 GiB``: a byte count as an operator reads it."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / MIB:.0f} MiB"


def _span(seconds: float) -> str:
    """``42s``, ``12m``, ``3h05m``: an idle time as an operator reads it."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"

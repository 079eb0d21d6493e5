"""Capacity limits (docs/hibernation.md "Capacity"): memory and LCHAT_MAX_AWAKE in the activator's
wake decision, LCHAT_MAX_INSTANCES (always-on) and LCHAT_MAX_REGISTERED in ``lchat add-instance``,
all in ``GET /status`` and ``lchat instances``.

The activator's part runs on the fake clock of tests/test_activator_machine.py (its harness,
imported: a real activator, lifecycle, lease, replication and ``file:`` bucket; fake children),
so every step is exact and each test takes milliseconds. :class:`WakeStormTests` is the real
thing: the router as twistd builds it, reference-space processes, concurrent HTTP requests.
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from lchat import config, tap, unixhttp
from lchat.admin import AdminAPI, Capacity
from lchat.config import ConfigError
from lchat.hibernation import capacity as capacity_module
from lchat.hibernation.activator import Activator
from lchat.hibernation.capacity import (
    MIB,
    RESERVE_FLOOR,
    Memory,
    MemoryReaders,
    proc_readers,
    read_meminfo,
    read_pss,
)
from lchat.hibernation.space import Budgets
from lchat.registry import Route, RouteTable
from lchat.router import LocalSocket
from tests.test_activator import _Harness, _open_websocket, sleep
from tests.test_activator_machine import _Machine, metric
from tests.test_cli import CliTestCase, serve_http

LIMIT = 3


class _AtCapacity(_Machine):
    """The machine's box with LCHAT_MAX_AWAKE=3 and ``self.always_on`` always-on processes."""

    def setUp(self) -> None:
        super().setUp()
        self.always_on = 0
        # The harness's own activator (no limit) stays idle: this one replaces it for the test.
        self.activator = self.build()
        self.activator.startService()

    def build(self) -> Activator:
        return Activator(
            self.clock,
            self.routes,
            self.lifecycle,
            self.claims,
            resident=lambda: self.always_on,
            max_awake=LIMIT,
        )

    def awake_at(self, host: str, at: float) -> None:
        """Wake ``host`` (a new space) at ``at`` seconds into the test: it is idle from then."""
        self.advance(at - self.now())
        self.add_space(host)
        self.awake(host)

    def running(self) -> list[str]:
        """The hosts whose (fake) space process runs now."""
        return sorted(c.host for c in self.spawner.children if c.exit_info is None)

    def terminated(self, host: str) -> int:
        return sum(len(c.terminations) for c in self.spawner.of(host))


class EvictionTests(_AtCapacity):
    def test_a_wake_at_the_limit_sleeps_the_space_idle_longest_and_spawns_once_it_is_gone(
        self,
    ) -> None:
        self.always_on = 1  # never counted
        self.awake_at("a.example", 0.0)
        self.awake_at("b.example", 10.0)
        self.awake_at("x.example", 15.0)
        route = self.add_space("c.example")
        self.advance(5.0)
        self.spawner.children[0].stop_delay = 2.5  # a's SIGTERM takes 2.5 s
        evictions = metric("lchat_capacity_evictions_total", reason="max_awake")
        slept = metric("lchat_sleeps_total", reason="capacity")
        mark = self.journal.mark()
        routed = self.activator.route(route)
        self.assertEqual(self.activator.state("a.example"), "stopping")  # idle longest (20 s)
        self.assertEqual(self.activator.state("b.example"), "awake")
        self.assertEqual(self.activator.state("c.example"), "waking")
        self.assertEqual(self.spawner.of("c.example"), [])  # a still runs: c waits for it
        self.assertEqual(self.activator.slots_held(), 3)  # a's slot is c's now
        self.advance(2.5)
        target = self.target(routed)
        assert isinstance(target, LocalSocket), target
        self.assertEqual(target.response_headers, ((b"x-lchat-wake", b"2.500s"),))
        events = [
            (event, detail)
            for _, event, detail in self.journal.entries[mark:]
            if event in ("terminate", "exit", "store.delete", "spawn")
        ]
        self.assertEqual(
            events,
            [
                ("terminate", "a.example"),
                ("exit", "a.example"),
                ("store.delete", "a.example/lock.json"),  # flushed and released first
                ("spawn", "c.example"),
            ],
        )
        self.assertEqual(self.running(), ["b.example", "c.example", "x.example"])
        self.assertEqual(self.activator.state("a.example"), "asleep")
        self.assertEqual(
            metric("lchat_capacity_evictions_total", reason="max_awake"), evictions + 1
        )
        self.assertEqual(metric("lchat_sleeps_total", reason="capacity"), slept + 1)
        self.assertEqual(metric("lchat_capacity_instances", kind="hibernating"), 3)
        self.assertEqual(metric("lchat_capacity_instances", kind="always_on"), 1)
        self.assertEqual(metric("lchat_capacity_instances", kind="max_awake"), LIMIT)

    def test_a_space_with_anything_in_flight_is_never_slept(self) -> None:
        self.awake_at("a.example", 0.0)  # idle longest, but serving a request
        self.awake_at("b.example", 5.0)
        self.awake_at("c.example", 10.0)
        ticket = self.target(self.activator.route(self.route("a.example")))
        assert isinstance(ticket, LocalSocket) and ticket.inflight is not None
        ticket.inflight.request_started(upgrade=False)
        self.advance(60.0)  # a's request takes a minute: its last activity is older still
        self.target(self.activator.route(self.add_space("d.example")))
        self.assertEqual(self.activator.state("a.example"), "awake")
        self.assertEqual(self.activator.state("b.example"), "asleep")
        self.assertEqual(self.activator.state("d.example"), "awake")
        self.assertEqual(self.activator.slots_held(), LIMIT)  # a, c and d: b's slot is free

    def test_at_the_limit_with_every_space_busy_the_wake_is_a_503_with_retry_after(
        self,
    ) -> None:
        tickets = []
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, 5.0 * i)
            routed = self.target(self.activator.route(self.route(host)))
            assert isinstance(routed, LocalSocket) and routed.inflight is not None
            routed.inflight.request_started(upgrade=True)  # a WebSocket: busy for hours
            tickets.append(routed.inflight)
        refused = metric("lchat_wakes_total", reason="request", outcome="capacity")
        route = self.add_space("d.example")
        answer = self.refused(self.activator.route(route), "capacity")
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"5")
        self.assertEqual(
            metric("lchat_wakes_total", reason="request", outcome="capacity"), refused + 1
        )
        self.assertEqual(self.spawner.of("d.example"), [])
        self.assertEqual(self.activator.state("d.example"), "asleep")
        self.assertEqual(
            [self.terminated(h) for h in ("a.example", "b.example", "c.example")], [0, 0, 0]
        )
        # Not a failed wake: no backoff. Once a space is free, the next request wakes it.
        tickets[1].request_ended(upgrade=True)
        self.advance(1.0)
        self.target(self.activator.route(route))
        self.assertEqual(self.activator.state("b.example"), "asleep")
        self.assertEqual(self.activator.state("d.example"), "awake")

    def test_always_on_processes_never_count_against_max_awake_and_are_never_slept(
        self,
    ) -> None:
        self.always_on = 100
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, 10.0 * i)
        self.assertEqual(self.running(), ["a.example", "b.example", "c.example"])
        self.advance(60.0)
        # The hibernating space idle longest is the one slept for the next.
        self.target(self.activator.route(self.add_space("d.example")))
        self.assertEqual(self.activator.state("a.example"), "asleep")
        self.assertEqual(self.running(), ["b.example", "c.example", "d.example"])

    def test_no_limit_never_sleeps_for_room(self) -> None:
        self.activator = Activator(
            self.clock, self.routes, self.lifecycle, self.claims, resident=lambda: 100
        )
        self.activator.startService()
        for i in range(LIMIT + 2):
            self.awake_at(f"s{i}.example", float(i))
        self.assertEqual(len(self.running()), LIMIT + 2)


class ConcurrencyTests(_AtCapacity):
    def test_wakes_arriving_together_each_take_a_different_slot_and_never_overshoot(
        self,
    ) -> None:
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, 10.0 * i)
        for child in self.spawner.children:
            child.stop_delay = 2.5  # each sleep takes a while: the wakes overlap them
        self.spawner.stop_delay = 0.0
        self.advance(10.0)
        routes = [self.add_space(h) for h in ("d.example", "e.example", "f.example", "g.example")]
        answers = [self.activator.route(r) for r in routes]
        answers += [self.activator.route(routes[0]) for _ in range(5)]  # join d's wake
        # d, e, f each took the slot of a different space (oldest idle first); g found nothing.
        self.assertEqual(
            [self.activator.state(h) for h in ("a.example", "b.example", "c.example")],
            ["stopping"] * 3,
        )
        self.refused(answers[3], "capacity")
        self.assertEqual(self.activator.slots_held(), LIMIT)
        peak = 0
        for _ in range(20):
            self.advance(0.25)
            peak = max(peak, len(self.running()))
            self.assertLessEqual(self.activator.slots_held(), LIMIT)
        self.assertLessEqual(peak, LIMIT)
        for answer in [*answers[:3], *answers[4:]]:
            self.assertIsInstance(self.target(answer), LocalSocket)
        self.assertEqual(self.running(), ["d.example", "e.example", "f.example"])
        self.assertEqual(
            [self.terminated(h) for h in ("a.example", "b.example", "c.example")], [1, 1, 1]
        )
        self.assertEqual(len(self.spawner.of("d.example")), 1)

    def test_a_wake_takes_the_slot_of_a_space_already_going_to_sleep(self) -> None:
        self.awake_at("a.example", 0.0)
        self.awake_at("b.example", 5.0)
        self.awake_at("c.example", 10.0)
        self.spawner.last("c.example").stop_delay = 2.5
        self.advance(60.0)
        self.activator.sleep("c.example", "idle")  # the idle sweep's, under way
        evictions = metric("lchat_capacity_evictions_total", reason="max_awake")
        routed = self.activator.route(self.add_space("d.example"))
        # No second sleep: c's slot is handed on; a (idle longest) stays awake.
        self.assertEqual(self.activator.state("a.example"), "awake")
        self.assertEqual(metric("lchat_capacity_evictions_total", reason="max_awake"), evictions)
        self.assertEqual(self.spawner.of("d.example"), [])
        self.advance(2.5)
        self.assertIsInstance(self.target(routed), LocalSocket)
        self.assertEqual(self.running(), ["a.example", "b.example", "d.example"])

    def test_a_waiting_wake_called_off_gives_the_slot_back(self) -> None:
        self.awake_at("a.example", 0.0)
        self.awake_at("b.example", 5.0)
        self.awake_at("c.example", 10.0)
        self.spawner.last("a.example").stop_delay = 5.0
        self.advance(10.0)
        waiting = self.activator.wake(self.add_space("d.example"), "admin")
        self.assertEqual(self.activator.state("a.example"), "stopping")
        self.activator.sleep("d.example", "admin")  # e.g. its row removed: the wake called off
        self.assertEqual(self.wake_failure(waiting).reason, "cancelled")
        self.assertEqual(self.activator.state("d.example"), "asleep")
        # a is still running: its slot is its own again, and the next wake waits for it.
        self.assertEqual(self.activator.slots_held(), LIMIT)
        routed = self.activator.route(self.add_space("e.example"))
        self.assertEqual(self.activator.state("b.example"), "awake")
        self.assertEqual(self.spawner.of("e.example"), [])
        self.advance(5.0)
        self.assertIsInstance(self.target(routed), LocalSocket)
        self.assertEqual(self.running(), ["b.example", "c.example", "e.example"])

    def test_the_wait_for_a_slot_is_within_the_wake_budget(self) -> None:
        self.activator.budgets = Budgets(wake=5.0)
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, float(i))
        self.contract.hang.add("a.example")  # its stand-down waits out the next-due budget (10 s)
        d = self.activator.wake(self.add_space("d.example"), "admin")
        self.advance(4.75)
        self.assertFalse(d.called)
        self.advance(0.25)
        self.assertEqual(self.wake_failure(d).reason, "timeout")
        self.assertEqual(self.spawner.of("d.example"), [])
        self.advance(10.0)
        self.assertEqual(self.activator.state("a.example"), "asleep")
        self.assertEqual(self.activator.slots_held(), 2)


PSS = 100 * MIB  # each fake space's measured memory (and LCHAT_SPACE_MEMORY here)
TOTAL = 8 << 30  # the fake box's MemTotal: the reserve is the 512 MiB floor (5 % is less)
CGROUP_LIMIT = 2 << 30


class _ByMemory(_AtCapacity):
    """The machine's box admitting wakes by memory, on fake kernel figures: ``room`` spaces of
    PSS fit above the reserve; each running fake child takes PSS; LCHAT_MAX_INSTANCES=3 (for
    always-on processes only) and no LCHAT_MAX_AWAKE."""

    room = 4

    def build(self) -> Activator:
        self.cgroup_others: int | None = (
            None  # what else the router's cgroup holds (None: no limit)
        )
        readers = MemoryReaders(self.meminfo, self.cgroup, self.pss)
        self.memory = Memory(readers, floor=PSS)
        self.logged: list[str] = []

        def observe(event: Any) -> None:
            self.logged.append(formatEvent(event) or "")

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        return Activator(
            self.clock,
            self.routes,
            self.lifecycle,
            self.claims,
            resident=lambda: self.always_on,
            max_instances=LIMIT,
            memory=self.memory,
        )

    def meminfo(self) -> dict[str, int]:
        free = RESERVE_FLOOR + self.room * PSS + PSS // 2 - PSS * len(self.running())
        return {"MemTotal": TOTAL, "MemAvailable": free}

    def cgroup(self) -> tuple[int, int] | None:
        if self.cgroup_others is None:
            return None
        return CGROUP_LIMIT, self.cgroup_others + PSS * len(self.running())

    def pss(self, pid: int) -> int | None:
        alive = [c for c in self.spawner.children if c.pid == pid and c.exit_info is None]
        return PSS if alive and not getattr(self, "closed", False) else None

    def busy(self, host: str) -> None:
        """An open WebSocket on ``host``'s awake space: never slept while it lasts."""
        routed = self.target(self.activator.route(self.route(host)))
        assert isinstance(routed, LocalSocket) and routed.inflight is not None
        routed.inflight.request_started(upgrade=True)


class MemoryTests(_ByMemory):
    room = 8

    def test_hibernating_wakes_are_not_capped_by_max_instances(self) -> None:
        evictions = metric("lchat_capacity_evictions_total", reason="memory")
        for i in range(2 * LIMIT):
            self.awake_at(f"s{i}.example", float(i))
        self.assertEqual(len(self.running()), 2 * LIMIT)
        self.assertEqual(metric("lchat_capacity_evictions_total", reason="memory"), evictions)

    def test_always_on_rows_at_max_instances_do_not_block_wakes(self) -> None:
        self.always_on = LIMIT + 2
        self.awake_at("a.example", 0.0)
        self.successResultOf(self.activator.wake(self.add_space("b.example"), "due"))
        self.assertEqual(self.running(), ["a.example", "b.example"])

    def test_the_cgroup_limit_wins_when_it_is_tighter(self) -> None:
        self.awake_at("a.example", 0.0)
        # The router's cgroup: room for one more space above the reserve, no more.
        self.cgroup_others = CGROUP_LIMIT - RESERVE_FLOOR - 2 * PSS - PSS // 2
        self.assertEqual(self.memory.available(), RESERVE_FLOOR + PSS + PSS // 2)
        self.assertEqual(self.memory.total(), CGROUP_LIMIT)
        self.awake_at("b.example", 10.0)
        self.target(self.activator.route(self.add_space("c.example")))
        self.assertEqual(self.activator.state("a.example"), "asleep")  # slept for c
        self.assertEqual(self.running(), ["b.example", "c.example"])

    def test_unreadable_pss_counts_the_whole_figure_and_is_said_once(self) -> None:
        self.closed = True  # smaps_rollup closed to the router (another uid)
        self.awake_at("a.example", 0.0)
        self.awake_at("b.example", 1.0)
        said = [line for line in self.logged if "smaps_rollup cannot be read" in line]
        self.assertEqual(len(said), 1, said)
        # Each counts its figure on top of the memory it uses: 8 - 2 - 2 = 4 more fit.
        self.assertEqual(self.activator.capacity()["awake_estimate"], 2 + 4)


class MemoryLimitTests(_ByMemory):
    room = 3

    def test_low_memory_sleeps_the_idle_longest_then_admits(self) -> None:
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, 10.0 * i)
        self.spawner.children[0].stop_delay = 2.5
        self.advance(10.0)
        evictions = metric("lchat_capacity_evictions_total", reason="memory")
        mark = self.journal.mark()
        routed = self.activator.route(self.add_space("d.example"))
        self.assertEqual(self.activator.state("a.example"), "stopping")  # idle longest
        self.assertEqual(self.spawner.of("d.example"), [])  # waits for a's memory
        self.advance(2.5)
        self.assertIsInstance(self.target(routed), LocalSocket)
        spawned = [d for _, e, d in self.journal.entries[mark:] if e in ("exit", "spawn")]
        self.assertEqual(spawned, ["a.example", "d.example"])
        self.assertEqual(self.running(), ["b.example", "c.example", "d.example"])
        self.assertEqual(metric("lchat_capacity_evictions_total", reason="memory"), evictions + 1)
        self.assertIn(
            "activator: memory (available 562 MiB, reserve 512 MiB, ~100 MiB a space, 0 MiB "
            "reserved): sleeping a.example (idle 30s) to wake d.example",
            self.logged,
        )

    def test_concurrent_wakes_reserve_memory_and_never_overshoot(self) -> None:
        self.room = 4
        for i, host in enumerate(("a.example", "b.example")):
            self.awake_at(host, 10.0 * i)
        self.spawner.ready = False  # the wakes below stay waking until their spaces answer
        self.advance(10.0)
        mark = self.journal.mark()
        routes = [self.add_space(h) for h in ("c.example", "d.example", "e.example", "f.example")]
        answers = [self.activator.route(r) for r in routes]
        answers.append(self.activator.route(self.add_space("g.example")))
        # c and d fit (each reserved as it was admitted); e and f take a's and b's memory; g
        # finds nothing to sleep: a 503 naming memory.
        self.assertEqual(
            [self.activator.state(h) for h in ("a.example", "b.example")], ["asleep"] * 2
        )
        self.refused(answers[4], "capacity")
        self.assertTrue(
            [line for line in self.logged if "g.example answered 503" in line], self.logged
        )
        events = [(e, d) for _, e, d in self.journal.entries[mark:] if e in ("spawn", "terminate")]
        self.assertEqual(
            events[:3], [("spawn", "c.example"), ("spawn", "d.example"), ("terminate", "a.example")]
        )
        peak = 0
        for _ in range(20):
            for child in self.spawner.children:
                if not child.is_ready and child.exit_info is None:
                    child.become_ready()
            self.advance(0.25)
            peak = max(peak, len(self.running()))
        self.assertLessEqual(peak, 4)
        for answer in answers[:4]:
            self.assertIsInstance(self.target(answer), LocalSocket)
        self.assertEqual(self.running(), ["c.example", "d.example", "e.example", "f.example"])

    def test_only_connected_spaces_and_no_memory_is_a_503_memory(self) -> None:
        for i, host in enumerate(("a.example", "b.example", "c.example")):
            self.awake_at(host, 5.0 * i)
            self.busy(host)
        refused = metric("lchat_wakes_total", reason="request", outcome="capacity")
        answer = self.refused(self.activator.route(self.add_space("d.example")), "capacity")
        self.assertEqual(dict(answer.headers)[b"retry-after"], b"5")
        self.assertEqual(
            metric("lchat_wakes_total", reason="request", outcome="capacity"), refused + 1
        )
        self.assertEqual(self.spawner.of("d.example"), [])
        self.assertEqual(self.running(), ["a.example", "b.example", "c.example"])
        self.assertTrue(
            [line for line in self.logged if "answered 503" in line and "memory (" in line]
        )

    def test_status_and_metrics_show_memory(self) -> None:
        self.awake_at("a.example", 0.0)
        admin = AdminAPI(
            self.clock,
            self.routes,
            "builtin",
            activator=self.activator,
            capacity=Capacity(LIMIT, 30, lambda: self.always_on),
        )
        available = RESERVE_FLOOR + 2 * PSS + PSS // 2
        self.assertEqual(
            admin.status()["capacity"],
            {
                "max_instances": LIMIT,
                "resident": 1,
                "always_on": 0,
                "hibernating": 1,
                "max_registered": 30,
                "registered": 1,
                "max_awake": 0,
                "mem_available": available,
                "mem_reserve": RESERVE_FLOOR,
                "per_space": PSS,
                "awake_estimate": 3,  # a, and two more
            },
        )
        self.assertEqual(metric("lchat_capacity_memory_bytes", kind="available"), available)
        self.assertEqual(metric("lchat_capacity_memory_bytes", kind="reserve"), RESERVE_FLOOR)
        self.assertEqual(metric("lchat_capacity_memory_bytes", kind="per_space"), PSS)
        self.assertEqual(metric("lchat_capacity_instances", kind="max"), LIMIT)

    def test_the_sweep_measures_spaces_and_the_average_follows(self) -> None:
        self.awake_at("a.example", 0.0)
        self.assertEqual(self.memory.average, PSS)  # read as it turned awake
        doubled = Memory(MemoryReaders(self.meminfo, lambda: None, lambda pid: 2 * PSS), floor=MIB)
        doubled.average = PSS
        self.activator._capacity.memory = doubled
        self.assertEqual(self.activator.measure_memory(), 1)
        self.assertEqual(doubled.per_space(), round(PSS + 0.2 * PSS))


class KernelReaderTests(SynchronousTestCase):
    def test_this_process_figures_from_proc(self) -> None:
        info = read_meminfo()
        self.assertGreater(info["MemTotal"], info["MemAvailable"])
        self.assertGreater(info["MemAvailable"], 0)
        pss = read_pss(os.getpid())
        assert pss is not None
        self.assertGreater(pss, MIB)
        self.assertIsNone(read_pss(2**22 + 1))  # beyond pid_max: no such process


class StatusTests(_AtCapacity):
    def test_get_status_shows_the_limits_and_what_counts_against_them(self) -> None:
        self.always_on = 1
        self.awake_at("a.example", 0.0)
        self.add_space("b.example")  # asleep: registered, not resident
        self.registry.insert(Route("svc.example", kind="service", socket="/srv/x.sock"))
        self.successResultOf(self.routes.reload("test"))
        admin = AdminAPI(
            self.clock,
            self.routes,
            "builtin",
            activator=self.activator,
            capacity=Capacity(LIMIT, 30, lambda: self.always_on),
        )
        self.assertEqual(
            admin.status()["capacity"],
            {
                "max_instances": LIMIT,
                "resident": 2,
                "always_on": 1,
                "hibernating": 1,
                "max_registered": 30,
                "registered": 2,  # instance rows; the service is not one
                "max_awake": LIMIT,  # (this activator measures no memory)
            },
        )
        without = AdminAPI(self.clock, self.routes, "builtin", capacity=Capacity(0, 0, lambda: 4))
        self.assertEqual(without.status()["capacity"]["resident"], 4)  # hibernation off


class LogTests(SynchronousTestCase):
    def test_a_box_over_max_instances_says_so_at_start_with_the_upgrade_note(self) -> None:
        cfg = config.load(
            environ={
                "LCHAT_DATA_DIR": "/tmp",
                "LCHAT_RUN_DIR": "/tmp",
                "LCHAT_UNITS": "builtin",
                "LCHAT_MAX_INSTANCES": "2",
            }
        )
        rows = [Route(f"s{i}.example", kind="instance", socket=f"/run/s{i}.sock") for i in range(3)]
        rows.append(Route("z.example", kind="instance", socket="/run/z.sock", hibernate=True))
        logged: list[str] = []

        def observe(event: Any) -> None:
            logged.append(formatEvent(event) or "")

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        tap._log_capacity(cfg, RouteTable({r.host: r for r in rows}), hibernation=True)
        self.assertTrue(
            [
                line
                for line in logged
                if "3 always-on spaces are registered here, over LCHAT_MAX_INSTANCES=2" in line
            ],
            logged,
        )
        self.assertTrue([line for line in logged if "LCHAT_MAX_AWAKE=0" in line], logged)

    def test_idle_spans_read_as_an_operator_reads_them(self) -> None:
        spans = [capacity_module._span(s) for s in (0.4, 42, 59.4, 60, 720, 3599, 3600, 11_100)]
        self.assertEqual(spans, ["0s", "42s", "59s", "1m", "12m", "59m", "1h00m", "3h05m"])


# -- configuration and the command line ----------------------------------------------------------


class ConfigTests(SynchronousTestCase):
    def load(self, **env: str) -> config.BoxConfig:
        environ = {"LCHAT_DATA_DIR": "/tmp", "LCHAT_RUN_DIR": "/tmp", "LCHAT_UNITS": "builtin"}
        return config.load(environ={**environ, **env})

    def test_defaults_forty_resident_and_ten_times_as_many_registered(self) -> None:
        cfg = self.load()
        self.assertEqual((cfg.max_instances, cfg.max_registered), (40, 400))
        cfg = self.load(LCHAT_MAX_INSTANCES="8")
        self.assertEqual((cfg.max_instances, cfg.max_registered), (8, 80))
        cfg = self.load(LCHAT_MAX_INSTANCES="8", LCHAT_MAX_REGISTERED="1000")
        self.assertEqual((cfg.max_instances, cfg.max_registered), (8, 1000))

    def test_memory_settings_and_max_awake(self) -> None:
        cfg = self.load()
        self.assertEqual((cfg.space_memory, cfg.memory_reserve, cfg.max_awake), (32 * MIB, None, 0))
        cfg = self.load(LCHAT_SPACE_MEMORY="48MiB", LCHAT_MEMORY_RESERVE="1G", LCHAT_MAX_AWAKE="40")
        self.assertEqual(
            (cfg.space_memory, cfg.memory_reserve, cfg.max_awake), (48 * MIB, 1 << 30, 40)
        )
        for name, bad in (
            ("LCHAT_SPACE_MEMORY", "512k"),  # below 1MiB: no space runs in that
            ("LCHAT_SPACE_MEMORY", "32MB"),
            ("LCHAT_MEMORY_RESERVE", "lots"),
            ("LCHAT_MAX_AWAKE", "-1"),
        ):
            with self.assertRaises(ConfigError) as caught:
                self.load(**{name: bad})
            self.assertIn(name, str(caught.exception))

    def test_zero_is_no_limit(self) -> None:
        cfg = self.load(LCHAT_MAX_INSTANCES="0")
        self.assertEqual((cfg.max_instances, cfg.max_registered), (0, 0))

    def test_anything_but_a_whole_number_is_refused_naming_the_variable(self) -> None:
        for name in ("LCHAT_MAX_INSTANCES", "LCHAT_MAX_REGISTERED"):
            for bad in ("-1", "ten", "4.5", "1e3", "\u00b2", "9999999999"):
                with self.assertRaises(ConfigError) as caught:
                    self.load(**{name: bad})
                self.assertIn(name, str(caught.exception))
        with self.assertRaises(ConfigError):
            self.load(LCHAT_MAX_INSTANCES="")


class CliTests(CliTestCase):
    def add_rows(self, count: int) -> None:
        self.registry.migrate()
        for i in range(count):
            self.registry.insert(
                Route(f"s{i}.example.com", kind="instance", socket=f"/run/s{i}.sock")
            )
        self.registry.insert(Route("svc.example.com", kind="service", socket="/srv/s.sock"))

    def test_add_instance_refuses_beyond_max_registered_and_writes_nothing(self) -> None:
        self.write_router_env(LCHAT_MAX_REGISTERED="2")
        self.add_rows(2)  # and a service: services do not count
        result = self.lchat("add-instance", "new.example.com")
        self.assertFailed(
            result, "2 instances are registered", "LCHAT_MAX_REGISTERED=2", self.env_file
        )
        self.assertIsNone(self.row("new.example.com"))
        self.assertFalse(os.path.exists(os.path.join(self.data_dir, "new.example.com.env")))
        # Raised (here by the environment, over the env file): accepted.
        os.environ["LCHAT_MAX_REGISTERED"] = "3"
        self.assertEqual(self.lchat("add-instance", "new.example.com").code, 0)
        os.environ["LCHAT_MAX_REGISTERED"] = "0"  # no limit
        self.assertEqual(self.lchat("add-instance", "more.example.com").code, 0)
        self.assertIn("4 registered (no limit)", self.lchat("instances").err)

    def test_max_instances_caps_always_on_spaces_at_add_instance_and_hibernate_off(
        self,
    ) -> None:
        self.write_router_env(LCHAT_MAX_INSTANCES="2")
        self.add_rows(2)  # always-on, both
        self.registry.insert(
            Route("sleepy.example.com", kind="instance", socket="/run/z.sock", hibernate=True)
        )
        result = self.lchat("add-instance", "new.example.com")
        self.assertFailed(
            result, "2 always-on instances run on this box", "LCHAT_MAX_INSTANCES=2", "--hibernate"
        )
        self.assertIsNone(self.row("new.example.com"))
        self.assertFalse(os.path.exists(os.path.join(self.data_dir, "new.example.com.env")))
        off = self.lchat("hibernate", "sleepy.example.com", "--off")
        self.assertFailed(off, "LCHAT_MAX_INSTANCES=2", "nothing was changed")
        route = self.row("sleepy.example.com")
        assert route is not None
        self.assertTrue(route.hibernate)

    def test_instances_prints_a_capacity_summary_on_stderr_and_json_is_unchanged(self) -> None:
        self.write_router_env(LCHAT_MAX_INSTANCES="5")
        self.add_rows(2)
        result = self.lchat("instances")
        self.assertEqual(result.code, 0, result)
        self.assertEqual(len(result.out.splitlines()), 4)  # the table alone: header + 3 rows
        self.assertIn(
            "lchat: capacity: ? of 5 always-on (the router cannot be asked), 2 of 50 registered",
            result.err,
        )
        listing = self.lchat("instances", "--json")
        self.assertEqual(len(json.loads(listing.out)), 3)
        self.assertNotIn("capacity", listing.err)
        # With a router to ask: its counts and its own limit.
        status: dict[str, object] = {
            "hosts": {},
            "capacity": {
                "max_instances": 6,
                "resident": 3,
                "always_on": 1,
                "hibernating": 2,
                "max_registered": 50,
                "registered": 2,
                "max_awake": 0,
                "awake_estimate": 690,
            },
        }
        server = serve_http(self.admin_socket, lambda method, path: (200, status))
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        result = self.lchat("instances")
        self.assertIn(
            "lchat: capacity: 1 of 6 always-on, 2 hibernating awake (~690 by memory), 2 of 50 "
            "registered",
            result.err,
        )


# -- the real thing --------------------------------------------------------------------------------


class WakeStormTests(_Harness):
    """The router as twistd builds it, six hibernating reference spaces and concurrent requests
    to all of them: room for three by LCHAT_MAX_AWAKE, or by memory (LCHAT_SPACE_MEMORY so large
    that three fit in this machine's memory, whatever it is); LCHAT_MAX_INSTANCES=1 caps none
    of them."""

    timeout = 90

    def test_a_wake_storm_beyond_max_awake(self) -> Any:
        # (LCHAT_MAX_INSTANCES=1: it caps always-on spaces only, never these wakes.)
        return self.storm(LCHAT_MAX_AWAKE="3", LCHAT_MAX_INSTANCES="1")

    @inlineCallbacks
    def test_a_wake_storm_beyond_memory(self) -> Any:
        # Room for 3.5 spaces of this figure above the reserve: a reference space's own few
        # tens of MiB, and the other users of this machine, move that by far less than half.
        here = Memory(proc_readers())
        figure = int((here.available() - here.reserve()) / 3.5)
        status = yield self.storm(LCHAT_SPACE_MEMORY=str(figure), LCHAT_MAX_INSTANCES="1")
        self.assertEqual(status["capacity"]["per_space"], figure)
        self.assertEqual(status["capacity"]["max_awake"], 0)

    def post(self, host: str) -> Any:
        return self.request(
            host, "/api/rooms/r/messages", b"POST", json.dumps({"body": host}).encode()
        )

    @inlineCallbacks
    def storm(self, **settings: str) -> Any:
        """The storm with ``settings`` that leave room for three; returns ``GET /status``."""
        hosts = [f"s{i}.example" for i in range(6)]
        for host in hosts:
            self.add_space(host)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="10m", **settings))
        activator = self.activator
        peak = [0]

        def sample() -> None:
            # Space processes alive right now (a stopping space's until it has exited).
            running = [
                s
                for s in activator._spaces.values()
                if s.child is not None and s.child.exit_info is None
            ]
            peak[0] = max(peak[0], len(running))

        sampler = LoopingCall(sample)
        sampler.start(0.01)

        def stop_sampling() -> None:
            if sampler.running:
                sampler.stop()

        self.addCleanup(stop_sampling)
        post = self.post

        # Three awake, s0 idle longest.
        for host in hosts[:3]:
            response, _ = yield post(host)
            self.assertEqual(response.code, 201)
            yield sleep(0.1)
        # One more: the idle-longest (s0) is slept for it, the others stay.
        response, _ = yield post(hosts[3])
        self.assertEqual(response.code, 201)
        self.assertEqual([self.state(h) for h in hosts[:4]], ["asleep", "awake", "awake", "awake"])

        # The storm: a request to every space at once (three awake, three asleep).
        results = yield DeferredList([post(h) for h in hosts], consumeErrors=True)
        codes = {}
        for host, (ok, value) in zip(hosts, results, strict=True):
            self.assertTrue(ok, value)
            response, body = value
            codes[host] = response.code
            if response.code == 503:
                self.assertTrue(response.headers.getRawHeaders(b"retry-after"), body)
        self.assertNotIn(502, codes.values())
        self.assertTrue(set(codes.values()) <= {201, 503}, codes)
        self.assertLessEqual(peak[0], 3)
        # Whatever was refused was refused because everything resident was busy (serving or
        # waking): asked again one at a time, each wakes by sleeping an idle one.
        for host in [h for h, code in codes.items() if code == 503]:
            response, _ = yield post(host)
            self.assertEqual(response.code, 201, host)
        self.assertLessEqual(peak[0], 3)

        # Every resident space busy (a WebSocket open on each): the next wake is a 503.
        awake = [h for h in hosts if self.state(h) == "awake"]
        self.assertEqual(len(awake), 3)
        sockets = []
        for host in awake:
            ws = yield deferToThread(_open_websocket, self.port, host, "/api/rooms/r/ws")
            sockets.append(ws)
        self.addCleanup(lambda: [ws.close() for ws in sockets])
        asleep = next(h for h in hosts if self.state(h) == "asleep")
        response, body = yield post(asleep)
        self.assertEqual(response.code, 503, body)
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"5"])
        # One tunnel closed: that space (now the only idle one) is slept for the wake.
        sockets[0].close()
        yield self.wait_for(lambda: activator.status()[awake[0]]["inflight"] == 0, timeout=10)
        response, _ = yield post(asleep)
        self.assertEqual(response.code, 201)
        self.assertEqual(self.state(awake[0]), "asleep")
        self.assertLessEqual(peak[0], 3)
        status = yield self.admin_status()
        self.assertEqual(
            {k: status["capacity"][k] for k in ("hibernating", "registered")},
            {"hibernating": 3, "registered": 6},
        )
        return status

    @inlineCallbacks
    def admin_status(self) -> Any:
        response = yield Deferred.fromCoroutine(
            unixhttp.request(reactor, self.cfg.admin_socket, "GET", "/status")
        )
        return json.loads(response.body)

"""lchat.workerpool on a fake clock: a process-recording MemoryReactorClock (tests/fakes.py) runs
the real Supervisor; the channel's ``ask`` is replaced by :class:`FakeAsk`, which records each call
and lets the test answer it (the seam the pool takes by constructor, in the spirit of Twisted's
procmon tests). Readiness probes are the real ``lchat.unixhttp`` client, answered in memory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from attrs import define
from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial import unittest

from lchat import unixhttp
from lchat.child import ChildSpec
from lchat.reactors import installed
from lchat.workerpool import WorkerPool
from tests.fakes import FakeProcess, FakeReactor

reactor = installed()


@define
class Call:
    sock: str
    method: str
    path: str
    timeout: float
    d: Deferred[tuple[int, Any]]

    def answer(self, code: int = 200, body: Any = None) -> None:
        self.d.callback((code, {} if body is None else body))


class FakeAsk:
    """Records each call; the test answers it (or lets it time out on the clock)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.raising: Exception | None = None  # every call raises this (a broken channel)

    def __call__(self, reactor, sock: str, method: str, path: str, timeout: float, /):
        if self.raising is not None:
            raise self.raising
        d: Deferred[tuple[int, Any]] = Deferred()
        self.calls.append(Call(sock, method, path, timeout, d))
        return d

    def pending(self, path: str = "", sock: str | None = None) -> list[Call]:
        return [
            c
            for c in self.calls
            if not c.d.called and c.path.startswith(path) and (sock is None or c.sock == sock)
        ]

    def answer_all(self, path: str, body: Any = None, sock: str | None = None) -> int:
        calls = self.pending(path, sock)
        for c in calls:
            c.answer(200, body)
        return len(calls)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Base(unittest.TestCase):
    workers = 2

    def setUp(self) -> None:
        self.r = FakeReactor()
        self.ask = FakeAsk()
        self.dir = tempfile.mkdtemp(prefix="wp", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.probes_answered = 0
        self.ended: list[int] = []
        self.fingerprint: object = [1, [2, 3]]
        self.certs: object = 5
        self.events: list[dict] = []
        observer: Any = self.events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def advance(self, seconds: float) -> None:
        """The clock moves on in small steps, as a real one does (``Clock.advance`` runs a
        LoopingCall once however long the jump); 1/8 s is exact in binary, so no drift."""
        steps = int(seconds * 8)
        for _ in range(steps):
            self.r.advance(0.125)
        self.r.advance(seconds - steps * 0.125)

    def sock(self, k: int) -> str:
        return os.path.join(self.dir, f"worker-{k}.sock")

    def spec(self, k: int) -> ChildSpec:
        path = self.sock(k)
        # The readiness probe dials only a socket file that exists: give each fake worker one.
        open(path, "w").close()
        return ChildSpec(
            name=f"w{k}",
            argv=("/bin/true", "--slot", str(k)),
            env={"LCHAT_WORKERS": str(self.workers)},
            ready_socket=path,
            fds={3: 100 + k, 4: 200 + k},
            inherit_output=True,
        )

    def pool(self, start: bool = True, ready: bool = True, **kw: Any) -> WorkerPool:
        kw.setdefault("routes_fingerprint", lambda: self.fingerprint)
        kw.setdefault("certificates", lambda: self.certs)
        kw.setdefault("on_ended", self.ended.append)
        kw.setdefault("kill_timeout", 25.0)
        pool = WorkerPool(
            self.r,
            [self.spec(k) for k in range(1, self.workers + 1)],
            self.ask,
            new_session=False,
            **kw,
        )
        if start:
            pool.startService()
            self.addCleanup(self.stop, pool)
            if ready:
                self.answer_probes()
        return pool

    def stop(self, pool: WorkerPool) -> None:
        if not pool.running:
            return
        d = pool.stopService()
        for p in self.r.processes:
            if p.pid is not None:
                p.exit(0)
        self.successResultOf(d)

    def answer_probes(self, status: int = 200) -> None:
        """Answer every readiness probe (GET /api/version) made since the last call."""
        for _path, factory, *_ in self.r.unixClients[self.probes_answered :]:
            proto = factory.buildProtocol(None)
            proto.makeConnection(StringTransport())
            proto.dataReceived(b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\n{}" % status)
        self.probes_answered = len(self.r.unixClients)

    def proc(self, k: int) -> FakeProcess:
        """The newest run of slot ``k``."""
        return [p for p in self.r.processes if p.args[-1] == str(k)][-1]

    def runs(self, k: int) -> int:
        return len([p for p in self.r.processes if p.args[-1] == str(k)])

    def logged(self, namespace: str = "lchat.workerpool") -> list[str]:
        return [formatEvent(e) for e in self.events if e.get("log_namespace") == namespace]

    def entry(self, pool: WorkerPool, k: int) -> dict[str, Any]:
        return pool.status()["list"][k - 1]

    def status_body(self, **kw: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "slot": 0,
            "routes_fingerprint": self.fingerprint,
            "certificates": self.certs,
            "connections": 3,
            "accepted": 10,
            "in_flight": 1,
        }
        body.update(kw)
        return body

    def tick(self, answer: Callable[[Call], None] | None = None) -> list[Call]:
        """One watchdog period; its pings answered with ``answer`` (default: all well)."""
        self.advance(2)
        pings = self.ask.pending("/status")
        for c in pings:
            (answer or (lambda c: c.answer(200, self.status_body())))(c)
        return pings


class Specs(Base):
    def test_each_slot_runs_its_spec_as_worker_k(self) -> None:
        self.pool()
        self.assertEqual(len(self.r.processes), 2)
        for k in (1, 2):
            p = self.proc(k)
            self.assertEqual(p.args, ["/bin/true", "--slot", str(k)])
            self.assertEqual(p.env, {"LCHAT_WORKERS": "2"})
            self.assertEqual(p.child_fds, {0: "w", 1: 1, 2: 2, 3: 100 + k, 4: 200 + k})
        started = [t for t in self.logged("lchat.supervise") if "started" in t]
        self.assertEqual(started, ["worker 1 started pid 40001", "worker 2 started pid 40002"])

    def test_refused_specs(self) -> None:
        with self.assertRaises(ValueError):
            WorkerPool(self.r, [], self.ask)
        with self.assertRaises(ValueError):
            WorkerPool(self.r, [ChildSpec("x", ("/bin/true",), {})], self.ask)

    def test_status_when_all_are_ready(self) -> None:
        pool = self.pool(ready=False)
        status = pool.status()
        self.assertEqual((status["wanted"], status["serving"]), (2, 0))
        self.assertEqual([e["state"] for e in status["list"]], ["starting", "starting"])
        self.answer_probes()
        self.tick()
        status = pool.status()
        self.assertEqual((status["wanted"], status["serving"]), (2, 2))
        self.assertEqual(
            status["list"][1],
            {
                "slot": 2,
                "pid": 40002,
                "state": "ready",
                "restarts": 0,
                "since": 0.0,
                "last_error": None,
                "routes_current": True,
                "certificates_current": True,
                "connections": 3,
                "accepted": 10,
                "in_flight": 1,
            },
        )
        self.assertEqual(metric("lchat_workers", state="ready"), 2)
        self.assertEqual(pool.worker_sockets(), [(1, self.sock(1)), (2, self.sock(2))])

    def test_only_ready_workers_are_asked(self) -> None:
        pool = self.pool(ready=False)
        self.assertEqual(pool.worker_sockets(), [])
        self.advance(2)
        self.assertEqual(self.ask.calls, [])  # no ping before ready
        pool.table_changed()
        self.assertEqual(self.ask.calls, [])
        self.assertEqual(
            self.successResultOf(pool.reload_all("x")), {"current": 0, "of": 2, "behind": []}
        )


class Supervision(Base):
    def test_backoff_1_2_4_5_5_and_reset_after_10s_healthy(self) -> None:
        before = metric("lchat_worker_restarts_total", slot="2")
        spaces_before = metric("lchat_space_restarts_total", host="2")
        self.pool(watch_every=1000)  # (unanswered pings would kill worker 1 meanwhile)
        delays = []
        for _ in range(5):
            self.proc(2).exit(None, sig=signal.SIGKILL)
            n = self.runs(2)
            waited = 0.0
            while self.runs(2) == n:
                self.advance(0.5)
                waited += 0.5
            delays.append(waited)
            self.answer_probes()
        self.assertEqual(delays, [1, 2, 4, 5, 5])
        self.assertEqual(metric("lchat_worker_restarts_total", slot="2"), before + 5)
        self.assertEqual(metric("lchat_space_restarts_total", host="2"), spaces_before)
        self.advance(10)  # healthy: the next crash waits 1 s again
        self.proc(2).exit(None, sig=signal.SIGKILL)
        n = self.runs(2)
        self.advance(1)
        self.assertEqual(self.runs(2), n + 1)
        self.assertIn(
            "worker 2 exited unexpectedly (killed by SIGKILL) — restarting in 1s",
            self.logged("lchat.supervise"),
        )
        self.assertEqual(self.runs(1), 1)

    def test_on_ended_for_every_run(self) -> None:
        pool = self.pool()
        self.proc(1).exit(1)
        self.assertEqual(self.ended, [1])
        self.advance(1)
        self.answer_probes()
        d = pool.stopService()
        for p in self.r.processes:
            if p.pid is not None:
                p.exit(0)
        self.successResultOf(d)
        self.assertEqual(sorted(self.ended), [1, 1, 2])

    def test_a_broken_on_ended_is_logged_and_harmless(self) -> None:
        def broken(slot: int) -> None:
            raise RuntimeError("boom")

        pool = self.pool(on_ended=broken)
        self.proc(1).exit(1)
        self.advance(1)
        self.assertEqual(self.runs(1), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        pool.on_ended = None

    def test_status_of_a_crashed_worker(self) -> None:
        pool = self.pool()
        self.tick()
        self.proc(2).exit(None, sig=signal.SIGSEGV)
        e = self.entry(pool, 2)
        self.assertEqual(
            (e["state"], e["pid"], e["last_error"], e["connections"]),
            ("backoff", None, "killed by SIGSEGV", None),
        )
        self.assertEqual(pool.status()["serving"], 1)
        self.assertEqual(pool.worker_sockets(), [(1, self.sock(1))])
        self.advance(1)
        self.answer_probes()
        e = self.entry(pool, 2)
        self.assertEqual((e["state"], e["restarts"], e["pid"]), ("ready", 1, 40003))


class Watchdog(Base):
    def test_pings_every_2s_and_caches_the_answer(self) -> None:
        pool = self.pool()
        self.advance(1.9)
        self.assertEqual(self.ask.calls, [])
        pings = self.tick(lambda c: c.answer(200, self.status_body(connections=7)))
        self.assertEqual(
            sorted((c.sock, c.method, c.path, c.timeout) for c in pings),
            [(self.sock(k), "GET", "/status", 2.0) for k in (1, 2)],
        )
        self.assertEqual(self.entry(pool, 1)["connections"], 7)
        self.assertEqual(len(self.tick()), 2)
        self.assertEqual(self.entry(pool, 1)["connections"], 3)

    def test_hung_worker_is_killed_and_replaced(self) -> None:
        kills = metric("lchat_worker_kills_total", why="hung")
        pool = self.pool()
        hung = self.proc(2)

        def only_worker_1(c: Call) -> None:
            if c.sock == self.sock(1):
                c.answer(200, self.status_body())

        for _ in range(3):  # pings at 2, 4, 6 s; each times out 2 s later
            self.tick(only_worker_1)
        self.assertEqual(hung.signals, [])
        self.advance(2)  # the third miss, at 8 s
        self.assertEqual(hung.signals, ["TERM"])
        self.assertIn("worker 2 did not answer for 6s: killing it", self.logged())
        self.assertEqual(metric("lchat_worker_kills_total", why="hung"), kills + 1)
        self.assertEqual(pool.status()["serving"], 1)
        self.advance(1)
        self.assertEqual(hung.signals, ["TERM", "KILL"])
        hung.exit(None, sig=signal.SIGKILL)
        self.assertIn(
            "worker 2 exited unexpectedly (killed by SIGKILL) — restarting in 1s",
            self.logged("lchat.supervise"),
        )
        self.advance(1)
        self.answer_probes()
        self.assertIsNot(self.proc(2), hung)
        self.assertEqual(self.entry(pool, 2)["state"], "ready")
        # The new run starts with a clean slate: answering is enough to be serving.
        self.tick()
        self.assertEqual(pool.status()["serving"], 2)
        self.assertEqual(metric("lchat_worker_kills_total", why="hung"), kills + 1)

    def test_no_second_kill_while_the_first_takes_effect(self) -> None:
        self.pool()
        hung = self.proc(1)
        for _ in range(6):
            self.tick(lambda c: None)
        self.assertEqual(hung.signals, ["TERM", "KILL"])
        self.assertEqual(
            len([t for t in self.logged() if t.startswith("worker 1 did not answer for")]), 1
        )

    def test_a_late_answer_resets_the_count(self) -> None:
        pool = self.pool()
        p = self.proc(1)
        self.tick(lambda c: None)
        self.tick(lambda c: None)  # two misses
        self.tick()  # answered
        self.tick(lambda c: None)
        self.tick(lambda c: None)
        self.advance(1.9)
        self.assertEqual(p.signals, [])
        self.assertEqual(pool.status()["serving"], 0)  # both missed their last ping

    def test_an_error_answer_is_a_miss(self) -> None:
        self.pool()
        p = self.proc(1)
        for _ in range(3):
            self.tick(lambda c: c.answer(500, b"oops"))
        self.assertEqual(p.signals, ["TERM"])

    def test_an_ask_that_raises_is_a_miss(self) -> None:
        self.pool()
        self.ask.raising = OSError("no such socket")
        for _ in range(3):
            self.advance(2)
        self.assertEqual(self.proc(1).signals, ["TERM"])

    def test_an_answer_from_a_previous_run_is_ignored(self) -> None:
        pool = self.pool()
        self.advance(2)
        [old] = self.ask.pending("/status", self.sock(2))
        self.proc(2).exit(1)
        self.assertTrue(old.d.called)  # cancelled with the run
        self.advance(1)
        self.answer_probes()
        self.assertIsNone(self.entry(pool, 2)["connections"])


class ReloadAll(Base):
    def test_waits_for_every_ack(self) -> None:
        pool = self.pool()
        d = pool.reload_all("SIGHUP to the control process")
        calls = self.ask.pending("/reload")
        self.assertEqual(
            sorted((c.sock, c.method, c.path, c.timeout) for c in calls),
            [
                (self.sock(k), "POST", "/reload?reason=SIGHUP%20to%20the%20control%20process", 5.0)
                for k in (1, 2)
            ],
        )
        calls[0].answer(200, {"fingerprint": [1, [2, 3]], "routes": 4})
        self.assertNoResult(d)
        calls[1].answer(200, {"fingerprint": (1, (2, 3)), "routes": 4})
        self.assertEqual(self.successResultOf(d), {"current": 2, "of": 2, "behind": []})
        self.assertEqual(self.entry(pool, 1)["routes_current"], True)

    def test_a_silent_worker_is_behind_after_5s(self) -> None:
        behind = metric("lchat_workers_behind", what="routes")
        pool = self.pool()
        d = pool.reload_all("cli")
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint}, self.sock(1))
        self.advance(4.9)
        self.assertNoResult(d)
        self.advance(0.1)
        self.assertEqual(self.successResultOf(d), {"current": 1, "of": 2, "behind": [2]})
        self.assertEqual(self.entry(pool, 2)["routes_current"], False)
        self.assertEqual(metric("lchat_workers_behind", what="routes"), behind + 1)
        warned = [t for t in self.logged() if "behind" in t]
        self.assertEqual(len(warned), 1)
        self.assertIn("worker 2 is behind on routes (no acknowledgement", warned[0])
        # its next answer on the control process's table clears it, and says so
        self.tick()
        self.assertEqual(self.entry(pool, 2)["routes_current"], True)
        self.assertEqual(metric("lchat_workers_behind", what="routes"), behind)
        self.assertIn("worker 2 caught up on routes", self.logged())

    def test_another_fingerprint_is_behind(self) -> None:
        pool = self.pool()
        d = pool.reload_all("cli")
        self.ask.answer_all("/reload", {"fingerprint": [9]}, self.sock(2))
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint})
        self.assertEqual(self.successResultOf(d), {"current": 1, "of": 2, "behind": [2]})
        del pool

    def test_the_callers_fingerprint_wins(self) -> None:
        pool = self.pool()
        d = pool.reload_all("cli", fingerprint=[7])
        self.ask.answer_all("/reload", {"fingerprint": [7]})
        self.assertEqual(self.successResultOf(d), {"current": 2, "of": 2, "behind": []})

    def test_without_a_reference_any_ack_is_current(self) -> None:
        pool = self.pool(routes_fingerprint=None)
        d = pool.reload_all("cli")
        self.ask.answer_all("/reload", {"routes": 1})
        self.assertEqual(self.successResultOf(d), {"current": 2, "of": 2, "behind": []})

    def test_an_error_answer_is_behind(self) -> None:
        pool = self.pool()
        d = pool.reload_all("cli")
        for c in self.ask.pending("/reload"):
            c.answer(500, b"broken registry")
        self.assertEqual(self.successResultOf(d), {"current": 0, "of": 2, "behind": [1, 2]})

    def test_a_worker_in_backoff_is_neither(self) -> None:
        pool = self.pool()
        self.proc(1).exit(1)
        d = pool.reload_all("cli")
        self.assertEqual(len(self.ask.pending("/reload")), 1)
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint})
        self.assertEqual(self.successResultOf(d), {"current": 1, "of": 2, "behind": []})


class Broadcasts(Base):
    def test_table_changed_pushes_a_reload_to_each(self) -> None:
        pool = self.pool()
        pool.table_changed()
        calls = self.ask.pending("/reload")
        self.assertEqual(sorted(c.sock for c in calls), [self.sock(1), self.sock(2)])
        self.assertEqual({c.timeout for c in calls}, {5.0})
        pool.certificates_changed()
        self.assertEqual(len(self.ask.pending("/rescan")), 2)

    def test_a_change_during_a_broadcast_is_exactly_one_more(self) -> None:
        pool = self.pool()
        pool.table_changed()
        self.assertEqual(len(self.ask.pending("/reload", self.sock(1))), 1)
        for _ in range(3):
            pool.table_changed()
        self.assertEqual(len(self.ask.pending("/reload", self.sock(1))), 1)  # queued, not sent
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint}, self.sock(1))
        self.assertEqual(len(self.ask.pending("/reload", self.sock(1))), 1)  # the one more
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint}, self.sock(1))
        self.assertEqual(len(self.ask.pending("/reload", self.sock(1))), 0)
        self.assertEqual(len([c for c in self.ask.calls if c.sock == self.sock(1)]), 2)
        # worker 2 never answered: still one in flight, one queued
        self.assertEqual(len([c for c in self.ask.calls if c.sock == self.sock(2)]), 1)
        self.advance(5)  # its push times out: the queued one goes
        self.assertEqual(len(self.ask.pending("/reload", self.sock(2))), 1)

    def test_routes_and_certificates_coalesce_separately(self) -> None:
        pool = self.pool()
        pool.table_changed()
        pool.certificates_changed()
        pool.certificates_changed()
        self.assertEqual(len(self.ask.pending("/reload", self.sock(1))), 1)
        self.assertEqual(len(self.ask.pending("/rescan", self.sock(1))), 1)
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint})
        self.assertEqual(len(self.ask.pending("/rescan", self.sock(1))), 1)  # still in flight
        self.ask.answer_all("/rescan", {"certificates": self.certs})
        self.assertEqual(len(self.ask.pending("/rescan", self.sock(1))), 1)  # the queued one

    def test_a_queued_push_is_dropped_when_the_worker_dies(self) -> None:
        pool = self.pool()
        pool.table_changed()
        pool.table_changed()
        self.proc(1).exit(1)
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint}, self.sock(1))
        self.assertEqual(len([c for c in self.ask.calls if c.sock == self.sock(1)]), 1)

    def test_a_failed_push_marks_it_behind(self) -> None:
        behind = metric("lchat_workers_behind", what="certificates")
        pool = self.pool()
        pool.certificates_changed()
        for c in self.ask.pending("/rescan", self.sock(2)):
            c.answer(503, b"")
        self.assertEqual(self.entry(pool, 2)["certificates_current"], False)
        self.assertEqual(metric("lchat_workers_behind", what="certificates"), behind + 1)
        self.assertIn(
            "worker 2 is behind on certificates (the push failed: answered 503); its own poll "
            "will catch up",
            self.logged(),
        )

    def test_a_behind_status_sends_one_push(self) -> None:
        behind = metric("lchat_workers_behind", what="routes")
        pool = self.pool()

        def worker_2_old(c: Call) -> None:
            old = c.sock == self.sock(2)
            c.answer(200, self.status_body(routes_fingerprint=[0] if old else self.fingerprint))

        self.tick(worker_2_old)
        self.assertEqual(self.entry(pool, 2)["routes_current"], False)
        self.assertEqual(metric("lchat_workers_behind", what="routes"), behind + 1)
        pushes = self.ask.pending("/reload")
        self.assertEqual([c.sock for c in pushes], [self.sock(2)])
        self.assertEqual([t for t in self.logged() if "behind" in t], [])  # not news yet
        pushes[0].answer(200, {"fingerprint": self.fingerprint})
        self.assertEqual(self.entry(pool, 2)["routes_current"], True)
        self.assertEqual(metric("lchat_workers_behind", what="routes"), behind)

    def test_certificates_compared_with_the_control_process(self) -> None:
        pool = self.pool()
        self.tick(lambda c: c.answer(200, self.status_body(certificates=4)))
        self.assertEqual([e["certificates_current"] for e in pool.status()["list"]], [False] * 2)
        self.assertEqual(len(self.ask.pending("/rescan")), 2)
        self.certs = 4  # the control process's own count caught up
        self.tick(lambda c: c.answer(200, self.status_body(certificates=4)))
        self.assertEqual([e["certificates_current"] for e in pool.status()["list"]], [True] * 2)

    def test_nothing_to_compare_is_unknown(self) -> None:
        pool = self.pool(routes_fingerprint=None, certificates=None)
        self.tick()
        self.assertEqual(self.entry(pool, 1)["routes_current"], None)
        self.assertEqual(self.entry(pool, 1)["certificates_current"], None)
        self.assertEqual(self.ask.pending("/reload"), [])


class Scrape(Base):
    def test_texts_of_those_that_answer(self) -> None:
        failures = metric("lchat_worker_scrape_failures_total")
        pool = self.pool()
        d = pool.scrape()
        calls = self.ask.pending("/metrics")
        self.assertEqual({(c.method, c.timeout) for c in calls}, {("GET", 1.0)})
        for c in calls:
            if c.sock == self.sock(1):
                c.d.callback((200, b"lchat_x 1\n"))
        self.advance(1)
        self.assertEqual(self.successResultOf(d), {1: "lchat_x 1\n", 2: None})
        self.assertEqual(metric("lchat_worker_scrape_failures_total"), failures + 1)


class Stop(Base):
    def test_sigterm_all_then_sigkill_after_kill_timeout(self) -> None:
        pool = self.pool(kill_timeout=25)
        self.tick()
        pool.table_changed()
        pool.table_changed()  # queued: never sent once stopping
        d = pool.stopService()
        p1, p2 = self.proc(1), self.proc(2)
        self.assertEqual((p1.signals, p2.signals), (["TERM"], ["TERM"]))
        p1.exit(0)
        self.advance(24.9)
        self.assertNoResult(d)
        self.assertEqual(self.ask.pending("/status"), [])  # the watchdog has stopped
        self.advance(0.1)
        self.assertEqual(p2.signals, ["TERM", "KILL"])
        self.assertNoResult(d)
        self.ask.answer_all("/reload", {"fingerprint": self.fingerprint})
        self.assertEqual(len(self.ask.pending("/reload")), 0)
        p2.exit(None, sig=signal.SIGKILL)
        self.successResultOf(d)
        self.assertEqual(len(self.r.processes), 2)  # nothing restarted
        self.assertEqual([e["state"] for e in pool.status()["list"]], ["stopped", "stopped"])
        self.assertEqual(metric("lchat_workers", state="stopped"), 2)
        self.assertFalse(self.r.getDelayedCalls())

    def test_a_stop_during_a_ping_cancels_it_quietly(self) -> None:
        pool = self.pool()
        self.advance(2)
        pings = self.ask.pending("/status")
        d = pool.stopService()
        self.assertTrue(all(c.d.called for c in pings))
        for p in self.r.processes:
            p.exit(0)
        self.successResultOf(d)
        self.assertEqual([t for t in self.logged() if "did not answer" in t], [])


# --- real processes -------------------------------------------------------------------------------

WORKER = r"""
import http.server, json, os, socketserver, sys

slot = sys.argv[1]
with open(os.environ["SOCK"] + ".fd3", "w") as f:  # the listening socket handed to this slot
    f.write(str(os.fstat(3).st_ino))


class H(http.server.BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/api/version":
            self.answer({"version": "test", "slot": int(slot), "pid": os.getpid()})
        else:
            self.answer({"slot": int(slot), "routes_fingerprint": [1],
                         "connections": 0, "accepted": 0, "in_flight": 0})

    def do_POST(self):
        self.answer({"fingerprint": [1], "routes": 0})

    def address_string(self):
        return "unix"

    def log_message(self, *a):
        pass


sock = os.environ["SOCK"]
if os.path.exists(sock):
    os.unlink(sock)
socketserver.UnixStreamServer(sock, H).serve_forever()
"""


def unix_ask(reactor: Any, sock: str, method: str, path: str, timeout: float, /):
    """The channel's contract over the real unix-socket HTTP client (lchat.unixhttp)."""

    async def call() -> tuple[int, Any]:
        resp = await unixhttp.request(reactor, sock, method, path, timeout=timeout)
        try:
            return resp.status, json.loads(resp.body)
        except ValueError:
            return resp.status, resp.body

    return Deferred.fromCoroutine(call())


class RealWorkers(unittest.TestCase):
    """Two real worker processes: their inherited sockets, a hung one replaced, a clean stop."""

    timeout = 30

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="wpr", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        script = os.path.join(self.dir, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        self.listeners = [socket.socket() for _ in range(2)]
        for s in self.listeners:
            self.addCleanup(s.close)
            s.bind(("127.0.0.1", 0))
            s.listen()
        self.specs = [
            ChildSpec(
                name=f"w{k}",
                argv=(sys.executable, script, str(k)),
                env={"SOCK": os.path.join(self.dir, f"worker-{k}.sock")},
                ready_socket=os.path.join(self.dir, f"worker-{k}.sock"),
                fds={3: self.listeners[k - 1].fileno()},
                inherit_output=True,
            )
            for k in (1, 2)
        ]

    async def until(self, pool: WorkerPool, check: Callable[[dict[str, Any]], bool]) -> None:
        for _ in range(200):
            if check(pool.status()):
                return
            await deferLater(reactor, 0.05)
        self.fail(f"never: {pool.status()}")

    async def test_hung_worker_replaced_and_stop(self) -> None:
        kills = metric("lchat_worker_kills_total", why="hung")
        pool = WorkerPool(
            reactor,
            self.specs,
            unix_ask,
            routes_fingerprint=lambda: (1,),
            min_restart_delay=0.1,
            watch_every=0.3,
            watch_timeout=0.3,
            kill_timeout=2,
        )
        pool.startService()
        self.addCleanup(lambda: pool.running and pool.stopService())
        await self.until(
            pool, lambda s: s["serving"] == 2 and all(e["routes_current"] for e in s["list"])
        )
        for spec, listener in zip(self.specs, self.listeners, strict=True):
            with open(f"{spec.ready_socket}.fd3") as f:  # noqa: ASYNC230 (a test's small file)
                self.assertEqual(int(f.read()), os.fstat(listener.fileno()).st_ino)
        self.assertEqual(await pool.reload_all("test"), {"current": 2, "of": 2, "behind": []})
        hung = pool.status()["list"][1]["pid"]
        os.kill(hung, signal.SIGSTOP)
        await self.until(
            pool,
            lambda s: s["list"][1]["pid"] not in (None, hung) and s["list"][1]["state"] == "ready",
        )
        self.assertEqual(metric("lchat_worker_kills_total", why="hung"), kills + 1)
        self.assertEqual(pool.status()["list"][1]["restarts"], 1)
        pids = [e["pid"] for e in pool.status()["list"]]
        await pool.stopService()
        self.assertEqual([e["state"] for e in pool.status()["list"]], ["stopped", "stopped"])
        for pid in pids:
            with self.assertRaises(ProcessLookupError):
                os.kill(pid, 0)

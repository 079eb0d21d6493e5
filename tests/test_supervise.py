"""lchat.supervise and lchat.child: fake-time unit tests (a process-recording MemoryReactorClock) and real-process
integration tests on the real reactor."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial import unittest

from lchat.child import MAX_LINE, ChildExited, ChildSpec, ExitInfo, ReadyTimeout, SpawnError, spawn
from lchat.reactors import installed
from lchat.supervise import STATES, Supervisor
from tests.fakes import FakeReactor

reactor = installed()
PY = sys.executable


# --- fakes ---------------------------------------------------------------------------------------


class States:
    """Records on_state calls; lets real-reactor tests wait for a state."""

    def __init__(self):
        self.events: list[tuple[str, str, str]] = []
        self._waiters: list[tuple[str, str, Deferred[str]]] = []

    def __call__(self, name: str, state: str, detail: str) -> None:
        self.events.append((name, state, detail))
        for w in list(self._waiters):
            if w[0] == name and w[1] == state:
                self._waiters.remove(w)
                w[2].callback(detail)

    def of(self, name: str) -> list[str]:
        return [s for n, s, _ in self.events if n == name]

    def wait(self, name: str, state: str, timeout: float = 10.0) -> Deferred[str]:
        d: Deferred[str] = Deferred()
        self._waiters.append((name, state, d))
        return d.addTimeout(timeout, reactor)


def spec(name="a.example.com", *argv: str, **kw: Any) -> ChildSpec:
    return ChildSpec(name=name, argv=argv or (PY, "-c", "pass"), env=kw.pop("env", {}), **kw)


def metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


class FakeTimeTests(unittest.TestCase):
    def setUp(self):
        self.r = FakeReactor()
        self.states = States()
        # The probe only dials a socket file that exists: give the fake children one.
        fd, self.sock = tempfile.mkstemp(suffix=".sock")
        os.close(fd)
        self.addCleanup(os.unlink, self.sock)

    def sup(self, **kw: Any) -> Supervisor:
        kw.setdefault("kill_timeout", 20.0)
        s = Supervisor(self.r, self.states, new_session=False, **kw)
        return s

    def test_backoff_doubles_and_caps(self):
        s = self.sup(min_restart_delay=1, max_restart_delay=8, healthy_after=100)
        s.want({"a": spec("a")})
        s.startService()
        self.assertEqual(len(self.r.processes), 1)
        self.assertEqual(self.states.of("a"), ["starting", "ready"])
        delays = []
        for _ in range(6):
            self.r.processes[-1].exit(1, stderr=b"oops\n")
            n = len(self.r.processes)
            waited = 0.0
            while len(self.r.processes) == n:
                self.r.advance(0.5)
                waited += 0.5
            delays.append(waited)
        self.assertEqual(delays, [1, 2, 4, 8, 8, 8])
        self.assertEqual(s.status()["a"].restarts, 6)
        self.assertEqual(s.status()["a"].last_error, "exited with code 1: oops")
        self.assertIn(("a", "backoff", "exited with code 1: oops"), self.states.events)

    def test_backoff_resets_after_healthy(self):
        s = self.sup(min_restart_delay=1, max_restart_delay=60, healthy_after=10)
        s.want({"a": spec("a")})
        s.startService()
        for delay in (1, 2, 4):
            self.r.processes[-1].exit(1)
            self.r.advance(delay - 0.01)
            n = len(self.r.processes)
            self.r.advance(0.02)
            self.assertEqual(len(self.r.processes), n + 1)
        self.r.advance(10)  # stays up healthy_after seconds after ready
        self.r.processes[-1].exit(1)
        n = len(self.r.processes)
        self.r.advance(1)
        self.assertEqual(len(self.r.processes), n + 1)

    def test_sigterm_then_sigkill_on_removal(self):
        s = self.sup(kill_timeout=20)
        s.want({"a": spec("a")})
        s.startService()
        p = self.r.processes[0]
        s.want({})
        self.assertEqual(p.signals, ["TERM"])
        self.r.advance(19.9)
        self.assertEqual(p.signals, ["TERM"])
        self.r.advance(0.2)
        self.assertEqual(p.signals, ["TERM", "KILL"])
        self.assertIn("a", s.status())  # still there until it is gone
        p.exit(None, sig=signal.SIGKILL)
        self.assertEqual(self.states.of("a")[-1], "stopped")
        self.assertEqual(s.status(), {})
        self.assertFalse(self.r.getDelayedCalls())

    def test_terminate_is_idempotent_and_safe_when_dead(self):
        child = spawn(self.r, spec("a"), new_session=False)
        p = self.r.processes[0]
        self.assertTrue(p.stdin_closed)
        d1 = child.terminate(timeout=20)
        d2 = child.terminate(timeout=5)  # brings SIGKILL forward, no second TERM
        self.assertEqual(p.signals, ["TERM"])
        self.r.advance(5)
        self.assertEqual(p.signals, ["TERM", "KILL"])
        self.assertNoResult(d1)
        p.exit(None, sig=signal.SIGKILL, stderr=b"last words\nbye")
        info = self.successResultOf(d1)
        self.assertEqual(self.successResultOf(d2), info)
        self.assertEqual(info, ExitInfo(None, signal.SIGKILL, ("last words", "bye")))
        self.assertEqual(info.describe(), "killed by SIGKILL")
        self.assertEqual(self.successResultOf(child.terminate()), info)
        self.assertEqual(self.successResultOf(child.ended), info)
        self.assertEqual(p.signals, ["TERM", "KILL"])

    def test_sigterm_exit_cancels_sigkill(self):
        child = spawn(self.r, spec("a"), new_session=False)
        p = self.r.processes[0]
        d = child.terminate(timeout=20)
        p.exit(0)
        self.assertEqual(self.successResultOf(d).code, 0)
        self.r.advance(30)
        self.assertEqual(p.signals, ["TERM"])

    def test_new_session_wraps_with_setsid(self):
        if shutil.which("setsid") is None:
            raise unittest.SkipTest("no setsid")
        spawn(self.r, spec("a", PY, "-c", "pass"))
        p = self.r.processes[0]
        self.assertEqual(os.path.basename(p.args[0]), "setsid")
        self.assertEqual(p.args[1:], [os.path.abspath(PY), "-c", "pass"])

    def test_want_add_remove_change(self):
        s = self.sup()
        s.want({"a": spec("a"), "b": spec("b", env={"X": "1"})})
        self.assertEqual(self.r.processes, [])  # nothing until started
        self.assertEqual(s.status()["a"].state, "stopped")
        s.startService()
        pa, pb = self.r.processes
        self.assertEqual(pb.env, {"X": "1"})
        s.want({"b": spec("b", env={"X": "2"}), "c": spec("c")})
        self.assertEqual(pa.signals, ["TERM"])
        self.assertEqual(pb.signals, ["TERM"])
        self.assertEqual(len(self.r.processes), 3)  # c started at once
        pa.exit(0)
        pb.exit(0)
        self.assertEqual(len(self.r.processes), 4)  # b again, with the new env
        self.assertEqual(self.r.processes[-1].env, {"X": "2"})
        self.assertEqual(sorted(s.status()), ["b", "c"])
        self.assertEqual(self.states.of("a")[-1], "stopped")
        self.assertEqual(s.status()["b"].restarts, 0)  # a replacement is not a crash
        # the same spec again changes nothing
        s.want({"b": spec("b", env={"X": "2"}), "c": spec("c")})
        self.assertEqual(len(self.r.processes), 4)
        self.assertEqual(self.r.processes[-1].signals, [])

    def test_readd_while_stopping_restarts(self):
        s = self.sup()
        s.want({"a": spec("a")})
        s.startService()
        s.want({})
        s.want({"a": spec("a")})
        self.r.processes[0].exit(0)
        self.assertEqual(len(self.r.processes), 2)
        self.assertEqual(s.status()["a"].state, "ready")

    def test_stop_service_terminates_all_and_cancels_restarts(self):
        s = self.sup(kill_timeout=5)
        s.want({"a": spec("a"), "b": spec("b"), "c": spec("c")})
        s.startService()
        pa, pb, pc = self.r.processes
        pc.exit(1)  # c now waits in backoff
        d = s.stopService()
        self.assertEqual((pa.signals, pb.signals), (["TERM"], ["TERM"]))
        self.assertNoResult(d)
        pa.exit(0)
        self.assertNoResult(d)
        self.r.advance(5)
        self.assertEqual(pb.signals, ["TERM", "KILL"])
        pb.exit(None, sig=signal.SIGKILL)
        self.successResultOf(d)
        self.r.advance(120)
        self.assertEqual(len(self.r.processes), 3)
        self.assertEqual(
            {n: st.state for n, st in s.status().items()}, dict.fromkeys("abc", "stopped")
        )
        self.assertFalse(self.r.getDelayedCalls())
        # and it comes back on start
        s.startService()
        self.assertEqual(len(self.r.processes), 6)

    def test_fail_after_then_recovers_to_ready(self):
        s = self.sup(min_restart_delay=1, max_restart_delay=4, fail_after=3, ready_timeout=30)
        s.want({"a": spec("a", ready_socket=self.sock)})
        s.startService()
        self.assertEqual(self.states.of("a"), ["starting"])
        detail = "exited with code 3 before becoming ready: config broken"
        self.r.processes[-1].exit(3, stderr=b"starting up\nconfig broken\n")
        self.assertEqual(self.states.events[-1], ("a", "backoff", detail))
        self.r.advance(1)
        self.r.processes[-1].exit(3, stderr=b"config broken\n")
        self.assertEqual(self.states.of("a")[-1], "backoff")
        self.r.advance(2)
        self.r.processes[-1].exit(3, stderr=b"config broken\n")
        self.assertEqual(self.states.events[-1], ("a", "failed", detail))
        self.assertEqual(metric("lchat_space_children", state="failed"), 1)
        # still retried at the capped backoff; stays "failed" meanwhile
        for delay in (4, 4):
            n = len(self.r.processes)
            self.r.advance(delay)
            self.assertEqual(len(self.r.processes), n + 1)
            self.assertEqual(s.status()["a"].state, "failed")
            self.r.processes[-1].exit(3, stderr=b"config broken\n")
        self.assertEqual(self.states.of("a").count("failed"), 1)  # reported once
        self.r.advance(4)
        self.r.answer_probe(200)
        self.assertEqual(self.states.of("a")[-1], "ready")
        st = s.status()["a"]
        self.assertEqual((st.state, st.pid), ("ready", self.r.processes[-1].pid))
        self.assertEqual(st.last_error, detail)  # the last error stays visible
        self.assertEqual(st.restarts, 5)
        self.assertEqual(metric("lchat_space_children", state="failed"), 0)
        self.assertEqual(metric("lchat_space_children", state="ready"), 1)

    def test_not_ready_in_time_is_a_failure(self):
        s = self.sup(ready_timeout=3, fail_after=1, kill_timeout=2)
        s.want({"a": spec("a", ready_socket="/nonexistent/a.sock")})
        s.startService()
        p = self.r.processes[0]
        for _ in range(40):
            self.r.advance(0.1)
        self.assertEqual(p.signals, ["TERM"])
        p.exit(0)
        state, detail = self.states.events[-1][1:]
        self.assertEqual(state, "failed")
        self.assertTrue(detail.startswith("not ready after 3s ("), detail)

    def test_probe_non_200_keeps_polling(self):
        child = spawn(self.r, spec("a", ready_socket=self.sock), new_session=False)
        d = child.wait_ready(timeout=10, interval=0.2)
        self.r.answer_probe(503)
        self.assertNoResult(d)
        self.r.advance(0.2)
        self.r.answer_probe(200)
        self.assertIsNone(self.successResultOf(d))

    def test_wait_ready_fails_when_child_exits(self):
        child = spawn(self.r, spec("a", ready_socket=self.sock), new_session=False)
        d = child.wait_ready()
        self.r.processes[0].exit(2, stderr=b"no db\n")
        f = self.failureResultOf(d, ChildExited)
        self.assertEqual(str(f.value), "exited with code 2 before becoming ready: no db")
        self.assertEqual(f.value.info.code, 2)
        self.assertFalse(self.r.getDelayedCalls())
        self.failureResultOf(child.wait_ready(), ChildExited)

    def test_wait_ready_times_out(self):
        child = spawn(self.r, spec("a", ready_socket=self.sock), new_session=False)
        d = child.wait_ready(timeout=1, interval=0.2)
        for _ in range(15):
            self.r.advance(0.1)
        f = self.failureResultOf(d, ReadyTimeout)
        self.assertIn("not ready after 1s", str(f.value))

    def test_spawn_error_fails_at_once_and_recovers_when_installed(self):
        tmp = tempfile.mkdtemp(prefix="sv", dir="/tmp")
        self.addCleanup(shutil.rmtree, tmp, True)
        binary = os.path.join(tmp, "space")
        s = self.sup(min_restart_delay=1, max_restart_delay=2)
        s.want({"a": spec("a", binary)})
        s.startService()
        self.assertEqual(self.r.processes, [])
        self.assertEqual(self.states.events, [("a", "failed", f"space binary {binary} not found")])
        self.r.advance(1)
        self.assertEqual(len(self.states.events), 1)  # retried, same detail, no new report
        with open(binary, "w") as f:
            f.write("#!/bin/sh\n")
        self.r.advance(2)
        self.assertEqual(
            self.states.events[-1][1:], ("failed", f"space binary {binary} is not executable")
        )
        os.chmod(binary, stat.S_IRWXU)
        self.r.advance(2)
        self.assertEqual(len(self.r.processes), 1)
        self.assertEqual(self.states.of("a")[-1], "ready")

    def test_spawn_errors(self):
        with self.assertRaises(SpawnError) as cm:
            spawn(self.r, spec("a", "no-such-binary-xyz", env={"PATH": "/nonexistent"}))
        self.assertEqual(str(cm.exception), "space binary no-such-binary-xyz not found on PATH")
        with self.assertRaises(SpawnError):
            spawn(self.r, spec("a", "/tmp"))
        with self.assertRaises(SpawnError) as cm:
            spawn(self.r, ChildSpec("a", (), {}))
        with self.assertRaises(SpawnError) as cm:
            spawn(self.r, spec("a", cwd="/nonexistent-dir"))
        self.assertIn("working directory", str(cm.exception))

    def test_path_lookup_uses_child_env(self):
        spawn(
            self.r, spec("a", "sh", "-c", "true", env={"PATH": "/bin:/usr/bin"}), new_session=False
        )
        self.assertTrue(os.path.isabs(self.r.processes[0].executable))

    def test_broken_callback_never_escapes(self):
        def bad(*a):
            raise RuntimeError("observer bug")

        s = Supervisor(self.r, bad, new_session=False)
        s.want({"a": spec("a")})
        s.startService()
        self.r.processes[0].exit(1)
        self.r.advance(1)
        self.assertEqual(len(self.r.processes), 2)
        self.assertEqual(s.status()["a"].state, "ready")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 5)  # one per state change

    def test_on_state_may_reenter(self):
        # A callback that changes the desired set mid-transition must see a consistent supervisor.
        s: Supervisor

        def on_state(name, state, detail):
            self.states(name, state, detail)
            if (name, state) == ("a", "stopped") and "a" not in s.status():
                s.want({"a": spec("a", env={"V": "2"})})
            if (name, state) == ("b", "backoff"):
                s.stopService()

        s = Supervisor(self.r, on_state, new_session=False)
        s.want({"a": spec("a")})
        s.startService()
        s.want({})
        self.r.processes[0].exit(0)
        self.assertEqual(len(self.r.processes), 2)  # re-added from inside the callback
        self.assertEqual(self.r.processes[1].env, {"V": "2"})
        self.assertEqual(s.status()["a"].state, "ready")
        s.want({"a": spec("a", env={"V": "2"}), "b": spec("b")})
        self.r.processes[2].exit(1)  # b crashes; the callback stops the service
        self.r.processes[1].exit(0)
        self.assertFalse(self.r.getDelayedCalls())
        self.assertEqual(len(self.r.processes), 3)

    def test_restart_counter_metric(self):
        before = metric("lchat_space_restarts_total", host="m.example.com") or 0
        s = self.sup(min_restart_delay=1)
        s.want({"m.example.com": spec("m.example.com")})
        s.startService()
        self.r.processes[-1].exit(1)
        self.r.advance(1)
        self.assertEqual(metric("lchat_space_restarts_total", host="m.example.com"), before + 1)

    def test_default_child_fds_are_todays(self):
        spawn(self.r, spec("a"), new_session=False)
        self.assertEqual(self.r.processes[0].child_fds, {0: "w", 1: "r", 2: "r"})

    def test_extra_fds_and_inherited_output_reach_spawn(self):
        s = self.sup()
        s.want({"2": spec("2", fds={3: 17, 4: 18}, inherit_output=True, noun="worker")})
        s.startService()
        p = self.r.processes[0]
        self.assertEqual(p.child_fds, {0: "w", 1: 1, 2: 2, 3: 17, 4: 18})
        self.assertTrue(p.stdin_closed)
        spawn(self.r, spec("b", fds={5: 9}), new_session=False)
        self.assertEqual(self.r.processes[1].child_fds, {0: "w", 1: "r", 2: "r", 5: 9})

    def test_extra_fds_never_replace_the_standard_three(self):
        for fds in ({0: 5}, {2: 5}, {3: -1}):
            with self.assertRaises(ValueError, msg=repr(fds)):
                spec("a", fds=fds)
        self.assertEqual(spec("a", fds={3: 5}), spec("a", fds={3: 5}))
        self.assertNotEqual(spec("a", fds={3: 5}), spec("a", fds={3: 6}))  # a new run

    def test_noun_and_metrics_of_another_kind_of_child(self):
        """A worker supervisor logs "worker 2 …" and counts into its own metrics, leaving the
        spaces' figures alone."""
        restarts = Counter("test_sv_worker_restarts", "t", ["slot"], registry=None)
        children = Gauge("test_sv_workers", "t", ["state"], registry=None)
        events: list[dict] = []
        observer: Any = events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        spaces = {st: metric("lchat_space_children", state=st) for st in STATES}
        before = metric("lchat_space_restarts_total", host="2")
        s = self.sup(noun="worker", restarts=restarts, children=children, min_restart_delay=1)
        s.want({"2": spec("2", noun="worker")})
        s.startService()
        self.assertEqual(children.labels(state="ready")._value.get(), 1)
        self.r.processes[-1].exit(None, sig=signal.SIGKILL)
        self.assertEqual(children.labels(state="backoff")._value.get(), 1)
        self.assertEqual(children.labels(state="ready")._value.get(), 0)
        self.r.advance(1)
        self.assertEqual(restarts.labels("2")._value.get(), 1)
        self.assertEqual(metric("lchat_space_restarts_total", host="2"), before)
        self.assertEqual({st: metric("lchat_space_children", state=st) for st in STATES}, spaces)
        texts = [formatEvent(e) for e in events if e.get("log_namespace") == "lchat.supervise"]
        self.assertIn("worker 2 exited unexpectedly (killed by SIGKILL) — restarting in 1s", texts)
        self.assertIn("worker 2 started pid 40002", texts)
        self.assertFalse([t for t in texts if "space" in t], texts)

    def test_on_exit_hears_every_run_end(self):
        """Ready or not, wanted or not: each run's end is reported once, before what follows."""
        exits: list[tuple[str, int | None, int]] = []
        s = self.sup(
            on_exit=lambda name, info: exits.append((name, info.code, len(self.r.processes))),
            fail_after=1,
        )
        s.want({"a": spec("a"), "b": spec("b", ready_socket=self.sock)})
        s.startService()
        self.r.processes[0].exit(1)  # ready, crashed
        self.r.processes[1].exit(2)  # never ready: failed
        self.r.advance(2)
        self.r.processes[3].exit(2)  # failed again: no new state, still reported
        s.want({"a": spec("a")})
        self.r.processes[2].exit(0)  # a's second run ends
        self.assertEqual([(n, c) for n, c, _ in exits], [("a", 1), ("b", 2), ("b", 2), ("a", 0)])
        self.assertEqual(exits[0][2], 2)  # reported before the restart was spawned

    def test_spawn_errors_name_the_noun(self):
        with self.assertRaises(SpawnError) as e:
            spawn(self.r, spec("3", "/nonexistent/python", noun="worker"), new_session=False)
        self.assertEqual(str(e.exception), "worker binary /nonexistent/python not found")

    def test_sigkill_log_names_the_noun(self):
        events: list[dict] = []
        observer: Any = events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        child = spawn(self.r, spec("2", noun="worker"), new_session=False)
        child.terminate(timeout=1)
        self.r.advance(1)
        texts = [formatEvent(e) for e in events if e.get("log_namespace") == "lchat.supervise"]
        self.assertEqual(texts, ["worker 2 did not stop after SIGTERM; sending SIGKILL"])

    def test_output_lines_logged_with_host(self):
        events: list[dict] = []
        observer: Any = events.append
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        spawn(self.r, spec("h.example.com"), new_session=False)
        proto = self.r.processes[0].proto
        proto.outReceived(b"hello\r\nwor")
        proto.outReceived(b"ld\n" + b"z" * (MAX_LINE + 50))
        proto.outReceived(b"tail-of-long-line\nnext\n")
        proto.errReceived(b"\xffbad utf8\n")
        lines = [
            (e["stream"], e["line"]) for e in events if e.get("log_namespace") == "lchat.space"
        ]
        self.assertEqual(lines[:2], [("stdout", "hello"), ("stdout", "world")])
        self.assertEqual(lines[2][1], "z" * MAX_LINE + "…")  # capped; rest dropped
        self.assertEqual(lines[3:], [("stdout", "next"), ("stderr", "\ufffdbad utf8")])
        self.assertTrue(all(e["host"] == "h.example.com" for e in events if "stream" in e))

    def test_spec_repr_hides_env(self):
        self.assertNotIn("s3cret", repr(spec("a", env={"LCHAT_ADMIN_TOKEN": "s3cret"})))


# --- real processes -----------------------------------------------------------------------------

SERVER = r"""
import http.server, os, signal, socketserver, subprocess, sys

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--grandchild" in sys.argv:
    p = subprocess.Popen(["sleep", "60"])
    with open(os.environ["GRANDCHILD_PID"], "w") as f:
        f.write(str(p.pid))
if "--fail" in sys.argv:
    print("config broken: LCHAT_DB missing", file=sys.stderr)
    sys.exit(3)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"version": "test", "build": "1"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self):
        return "unix"

    def log_message(self, *a):
        pass

class S(socketserver.UnixStreamServer):
    pass

sock = os.environ["LCHAT_SOCKET"]
if os.path.exists(sock):
    os.unlink(sock)
srv = S(sock, H)
print("listening on", sock, flush=True)
srv.serve_forever()
"""


def _read_pid(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone for our purposes when its state is Z
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class RealProcessTests(unittest.TestCase):
    timeout = 20

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sv", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.script = os.path.join(self.dir, "srv.py")
        with open(self.script, "w") as f:
            f.write(SERVER)
        self.states = States()

    def spec(self, name: str, *flags: str, ready: bool = True, **env: str) -> ChildSpec:
        sock = os.path.join(self.dir, f"{name}.sock")
        return ChildSpec(
            name=name,
            argv=(PY, self.script, *flags),
            env={"LCHAT_SOCKET": sock, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
            ready_socket=sock if ready else None,
        )

    def sup(self, **kw: Any) -> Supervisor:
        kw.setdefault("kill_timeout", 1)
        kw.setdefault("min_restart_delay", 0.1)
        kw.setdefault("ready_timeout", 10)
        s = Supervisor(reactor, self.states, **kw)
        self.addCleanup(s.stopService)
        return s

    async def test_becomes_ready_and_stops(self):
        s = self.sup()
        s.want({"a": self.spec("a"), "b": self.spec("b")})
        s.startService()
        await self.states.wait("a", "ready")
        if s.status()["b"].state != "ready":
            await self.states.wait("b", "ready")
        pids = [st.pid for st in s.status().values()]
        self.assertTrue(all(pids))
        await s.stopService()
        self.assertEqual({st.state for st in s.status().values()}, {"stopped"})
        self.assertTrue(all(_gone(p) for p in pids if p))

    async def test_exits_at_once_becomes_failed_with_stderr(self):
        s = self.sup(fail_after=2, min_restart_delay=0.05)
        s.want({"a": self.spec("a", "--fail")})
        s.startService()
        detail = await self.states.wait("a", "failed")
        self.assertEqual(
            detail, "exited with code 3 before becoming ready: config broken: LCHAT_DB missing"
        )
        self.assertEqual(self.states.of("a")[:3], ["starting", "backoff", "starting"])

    async def test_missing_binary_fails_clearly(self):
        s = self.sup()
        missing = os.path.join(self.dir, "live", "x.example.com")
        s.want({"x.example.com": ChildSpec("x.example.com", (missing,), {})})
        s.startService()
        self.assertEqual(
            self.states.events, [("x.example.com", "failed", f"space binary {missing} not found")]
        )
        self.assertEqual(
            s.status()["x.example.com"].last_error, f"space binary {missing} not found"
        )

    async def test_ignores_sigterm_is_killed(self):
        child = spawn(reactor, self.spec("a", "--ignore-term"))
        self.addCleanup(child.terminate, 0)
        await child.wait_ready(timeout=10)
        start = reactor.seconds()
        info = await child.terminate(timeout=1)
        self.assertEqual(info.signal, signal.SIGKILL)
        self.assertGreaterEqual(reactor.seconds() - start, 0.9)

    async def test_group_dies_with_the_child(self):
        pidfile = os.path.join(self.dir, "gc.pid")
        child = spawn(reactor, self.spec("a", "--grandchild", GRANDCHILD_PID=pidfile))
        self.addCleanup(child.terminate, 0)
        await child.wait_ready(timeout=10)
        grandchild = _read_pid(pidfile)
        self.assertFalse(_gone(grandchild))
        info = await child.terminate(timeout=1)
        self.assertEqual(info.signal, signal.SIGTERM)
        for _ in range(50):
            if _gone(grandchild):
                break
            await deferLater(reactor, 0.05)
        self.assertTrue(_gone(grandchild))

    async def test_orphans_are_swept_when_the_child_exits(self):
        pidfile = os.path.join(self.dir, "gc.pid")
        child = spawn(reactor, self.spec("a", "--grandchild", "--fail", GRANDCHILD_PID=pidfile))
        info = await child.ended
        self.assertEqual(info.code, 3)
        grandchild = _read_pid(pidfile)
        for _ in range(50):
            if _gone(grandchild):
                break
            await deferLater(reactor, 0.05)
        self.assertTrue(_gone(grandchild))

    async def test_ended_fires_even_if_an_orphan_holds_the_pipes(self):
        # Without our own session nothing sweeps the orphan; the pipe grace still ends the wait.
        pidfile = os.path.join(self.dir, "gc.pid")
        spec = self.spec("a", "--grandchild", "--fail", GRANDCHILD_PID=pidfile)
        child = spawn(reactor, spec, new_session=False)
        info = await child.ended
        grandchild = _read_pid(pidfile)
        self.addCleanup(os.kill, grandchild, signal.SIGKILL)
        self.assertEqual(info.code, 3)
        self.assertFalse(_gone(grandchild))

    async def test_killed_from_outside_is_restarted(self):
        s = self.sup()
        s.want({"a": self.spec("a")})
        s.startService()
        await self.states.wait("a", "ready")
        pid = s.status()["a"].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        why = await self.states.wait("a", "backoff")
        self.assertEqual(why, "killed by SIGKILL")
        await self.states.wait("a", "ready")
        st = s.status()["a"]
        self.assertNotEqual(st.pid, pid)
        self.assertEqual(st.restarts, 1)

    async def test_ready_without_socket_and_clean_exit_info(self):
        child = spawn(
            reactor,
            ChildSpec("a", (PY, "-c", "import sys; print('bye', file=sys.stderr)"), {}),
        )
        await child.wait_ready()
        info = await child.ended
        self.assertEqual(info, ExitInfo(code=0, signal=None, stderr_tail=("bye",)))
        self.assertEqual(info.describe(), "exited with code 0")

    async def test_extra_fds_and_inherited_output(self):
        """A worker's listening sockets arrive at the fd numbers its spec names; with
        inherit_output its stdout and stderr are ours (the journal), not pipes."""
        ours, theirs = socket.socketpair()
        self.addCleanup(ours.close)
        self.addCleanup(theirs.close)
        code = (
            "import os; out = os.readlink('/proc/self/fd/1') + ' ' + os.readlink('/proc/self/fd/2');"
            "os.write(3, out.encode()); os.close(3)"
        )
        child = spawn(
            reactor,
            ChildSpec("1", (PY, "-c", code), {}, fds={3: theirs.fileno()}, inherit_output=True),
        )
        info = await child.ended
        self.assertEqual(info, ExitInfo(code=0, signal=None))
        theirs.close()  # our copy stays open until we close it: the child had its own
        got = ours.recv(4096).decode()
        self.assertEqual(got, f"{os.readlink('/proc/self/fd/1')} {os.readlink('/proc/self/fd/2')}")

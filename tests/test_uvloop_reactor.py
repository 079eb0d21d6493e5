"""lchat.uvloop_reactor: the router's reactor (Twisted's asyncio reactor on a uvloop loop)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from lchat import uvloop_reactor

reactor: Any = _reactor
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")


class _Ended(ProcessProtocol):
    def __init__(self) -> None:
        self.ended: Deferred[object] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(type(reason.value))


class ReactorTests(TestCase):
    def test_the_suite_runs_on_it(self) -> None:
        """make test runs every module with --reactor=uvloop: what the router runs on."""
        self.assertTrue(uvloop_reactor.running_on_uvloop(reactor), type(reactor))
        self.assertIs(uvloop_reactor.loop_of(reactor), asyncio.get_event_loop())

    async def test_a_child_that_closes_its_pipes_is_still_reaped(self) -> None:
        """uvloop takes the signal wakeup fd Twisted's SIGCHLD handling relies on: a child whose
        pipes close before it exits must still end (its pidfd says so)."""
        ended = _Ended()
        reactor.spawnProcess(ended, "/bin/sh", ["sh", "-c", "exec >&- 2>&- <&-; sleep 0.2"], env={})
        self.assertIs(await ended.ended, ProcessDone)

    def test_loop_of_another_reactor_names_the_fix(self) -> None:
        with self.assertRaises(RuntimeError) as caught:
            uvloop_reactor.loop_of(object())
        self.assertIn("twistd lchat", str(caught.exception))


class TwistdTests(TestCase):
    """``twistd lchat`` on its own installs uvloop; another reactor is refused at start."""

    def twistd(self, *reactor_flag: str) -> tuple[list[str], str]:
        """A ``twistd lchat`` command line on a fresh data directory, and that directory."""
        data = tempfile.mkdtemp(prefix="uvr", dir="/tmp")
        self.addCleanup(subprocess.run, ["rm", "-rf", data], check=False)
        os.makedirs(os.path.join(data, "run"))
        argv = [
            TWISTD,
            "--nodaemon",
            "--pidfile=",
            *reactor_flag,
            "lchat",
            "--data-dir",
            data,
            "--run-dir",
            os.path.join(data, "run"),
            "--http",
            "127.0.0.1:0",
            "--https",
            "off",
            "--units",
            "builtin",
        ]
        return argv, data

    def test_another_reactor_is_refused_naming_the_fix(self) -> None:
        argv, data = self.twistd("--reactor=epoll")
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=data)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("runs on uvloop", result.stdout + result.stderr)
        self.assertIn("twistd lchat", result.stdout + result.stderr)

    def test_the_router_runs_on_uvloop_by_itself(self) -> None:
        argv, data = self.twistd()
        proc = subprocess.Popen(
            argv,
            env={**os.environ, "LCHAT_WORKERS": "1"},  # (one process; auto: one a core)
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=data,
        )
        self.addCleanup(lambda: None if proc.poll() is not None else proc.kill())
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "reactor class" in line:
                break
        # Running (its signal handlers installed) once the admin socket answers.
        admin = os.path.join(data, "run", "router.sock")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(2)
                    sock.connect(admin)
                    sock.sendall(b"GET /v1/instances HTTP/1.0\r\n\r\n")
                    if sock.recv(100):
                        break
            except OSError:
                time.sleep(0.1)
        proc.terminate()
        rest, _ = proc.communicate(timeout=20)
        text = "".join(seen) + rest
        self.assertIn("UvloopReactor", text)
        # (twistd then exits by the signal it got, as Twisted does: returncode -15.)
        self.assertIn("Received SIGTERM, shutting down.", text)
        self.assertIn("Server Shut Down.", text)

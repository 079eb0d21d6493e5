"""lchat.workerchannel over real unix sockets in this process: both sides' sites, the calls'
failures, and a worker's WorkerLink asking a real control site (its memory on a task.Clock)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any, cast

from prometheus_client import REGISTRY
from twisted.internet import task
from twisted.internet.defer import Deferred, succeed
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher
from twisted.trial import unittest
from twisted.web.server import Site

import lchat
from lchat import workerchannel
from lchat.reactors import installed
from lchat.workerchannel import (
    ChannelError,
    ChannelRefused,
    ChannelTimeout,
    WorkerLink,
    ask,
    control_site,
    worker_site,
)

reactor = installed()


def failures(call: str, why: str) -> float:
    return (
        REGISTRY.get_sample_value("lchat_worker_channel_failures_total", {"call": call, "why": why})
        or 0.0
    )


def cert_answers(answer: str) -> float:
    return REGISTRY.get_sample_value("lchat_worker_cert_wanted_total", {"answer": answer}) or 0.0


async def until(check: Callable[[], bool], within: float = 5.0) -> None:
    """Let the reactor run until ``check()`` is true."""
    waited = 0.0
    while not check():
        if waited > within:
            raise AssertionError("timed out waiting")
        await task.deferLater(reactor, 0.01)
        waited += 0.01


class _SocketDir(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="wc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def serve(self, site: Site, name: str = "s.sock") -> str:
        path = os.path.join(self.dir, name)
        port = reactor.listenUNIX(path, cast(Any, site))
        self.addCleanup(port.stopListening)
        return path

    async def raw(self, path: str, data: bytes) -> bytes:
        """``data`` sent on a plain socket; what comes back until the server closes."""

        def exchange() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                s.sendall(data)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
                return got

        return await deferToThread(exchange)


class WorkerSiteTests(_SocketDir):
    def setUp(self) -> None:
        super().setUp()
        self.reloads: list[str] = []
        self.rescans = 0
        self.reload_answer: Any = None  # None: answer at once

        def reload(reason: str) -> Any:
            self.reloads.append(reason)
            if self.reload_answer is not None:
                return self.reload_answer
            return {"fingerprint": "f1", "routes": 3}

        def rescan() -> Any:
            self.rescans += 1
            return succeed({"certificates": 2})

        self.status = {"slot": 2, "pid": 7, "routes": 3, "connections": 1}
        self.path = self.serve(
            worker_site(reload, rescan, lambda: self.status, lambda: b"# metrics\nx 1.0\n")
        )

    async def test_version_names_the_slot_and_the_process(self) -> None:
        status, body = await ask(reactor, self.path, "GET", "/api/version", 5)
        self.assertEqual(status, 200)
        self.assertEqual(body, {"version": lchat.__version__, "slot": 2, "pid": os.getpid()})

    async def test_version_takes_the_slot_given(self) -> None:
        path = self.serve(worker_site(lambda r: {}, lambda: {}, dict, bytes, slot=5), "other.sock")
        _, body = await ask(reactor, path, "GET", "/api/version", 5)
        self.assertEqual(body["slot"], 5)

    async def test_status(self) -> None:
        self.assertEqual(await ask(reactor, self.path, "GET", "/status", 5), (200, self.status))

    async def test_metrics_are_prometheus_text(self) -> None:
        status, body = await ask(reactor, self.path, "GET", "/metrics", 5)
        self.assertEqual((status, body), (200, b"# metrics\nx 1.0\n"))

    async def test_reload_answers_once_the_routes_are_reloaded(self) -> None:
        later: Deferred[dict[str, Any]] = Deferred()
        self.reload_answer = later
        call = ask(reactor, self.path, "POST", "/reload?reason=SIGHUP", 5)
        await until(lambda: bool(self.reloads))
        self.assertFalse(call.called)
        later.callback({"fingerprint": "f2", "routes": 4})
        self.assertEqual(await call, (200, {"fingerprint": "f2", "routes": 4}))
        self.assertEqual(self.reloads, ["SIGHUP"])

    async def test_reload_without_a_reason(self) -> None:
        self.assertEqual(
            await ask(reactor, self.path, "POST", "/reload", 5),
            (200, {"fingerprint": "f1", "routes": 3}),
        )
        self.assertEqual(self.reloads, ["control"])

    async def test_a_failed_reload_is_a_500_naming_it(self) -> None:
        later: Deferred[dict[str, Any]] = Deferred()
        self.reload_answer = later
        call = ask(reactor, self.path, "POST", "/reload", 5)
        await until(lambda: bool(self.reloads))
        later.errback(OSError("registry.db: disk I/O error"))
        status, body = await call
        self.assertEqual(status, 500)
        self.assertIn("disk I/O error", body["error"])
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)

    async def test_a_raising_callable_is_a_500_without_a_traceback(self) -> None:
        def broken() -> dict[str, Any]:
            raise RuntimeError("boom")

        path = self.serve(worker_site(lambda r: {}, lambda: {}, broken, bytes), "b.sock")
        status, body = await ask(reactor, path, "GET", "/status", 5)
        self.assertEqual(status, 500)
        self.assertNotIn("Traceback", str(body))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    async def test_rescan(self) -> None:
        self.assertEqual(
            await ask(reactor, self.path, "POST", "/rescan", 5), (200, {"certificates": 2})
        )
        self.assertEqual(self.rescans, 1)

    async def test_an_unknown_path_is_a_404(self) -> None:
        self.assertEqual(
            await ask(reactor, self.path, "GET", "/nope", 5), (404, {"error": "not found"})
        )

    async def test_a_wrong_method_is_a_405(self) -> None:
        status, body = await ask(reactor, self.path, "GET", "/reload", 5)
        self.assertEqual(status, 405)
        self.assertIn("POST", body["error"])
        self.assertEqual(self.reloads, [])
        status, _ = await ask(reactor, self.path, "DELETE", "/status", 5)
        self.assertEqual(status, 405)

    async def test_a_bad_reason_is_a_400(self) -> None:
        status, body = await ask(reactor, self.path, "POST", "/reload?reason=%FF", 5)
        self.assertEqual((status, body), (400, {"error": "bad reason: not UTF-8"}))
        status, _ = await ask(reactor, self.path, "POST", "/reload?reason=" + "x" * 300, 5)
        self.assertEqual(status, 400)
        self.assertEqual(self.reloads, [])

    async def test_garbage_is_a_400(self) -> None:
        got = await self.raw(self.path, b"\x16\x03\x01 not http at all\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 400 "), got)
        self.assertNotIn(b"Traceback", got)


class ControlSiteTests(_SocketDir):
    async def test_cert_wanted_asks_the_issuer(self) -> None:
        asked: list[str] = []

        def want(host: str) -> bool:
            asked.append(host)
            return host == "new.example.com"

        path = self.serve(control_site(want))
        got = await ask(reactor, path, "POST", "/cert-wanted?host=New.Example.com", 5)
        self.assertEqual(got, (200, {"coming": True}))
        got = await ask(reactor, path, "POST", "/cert-wanted?host=other.example.com", 5)
        self.assertEqual(got, (200, {"coming": False}))
        self.assertEqual(asked, ["new.example.com", "other.example.com"])

    async def test_no_issuer_means_nothing_is_coming(self) -> None:
        path = self.serve(control_site(None))
        got = await ask(reactor, path, "POST", "/cert-wanted?host=a.example.com", 5)
        self.assertEqual(got, (200, {"coming": False}))

    async def test_a_bad_host_is_a_400(self) -> None:
        asked: list[str] = []

        def want(host: str) -> bool:
            asked.append(host)
            return True

        path = self.serve(control_site(want))
        for query in ("", "?host=", "?host=a%20b", "?host=%FF"):
            status, body = await ask(reactor, path, "POST", "/cert-wanted" + query, 5)
            self.assertEqual(status, 400, query)
            self.assertTrue(body["error"].startswith("bad host"), body)
        self.assertEqual(asked, [])

    async def test_other_paths_and_methods(self) -> None:
        path = self.serve(control_site(None))
        self.assertEqual((await ask(reactor, path, "GET", "/cert-wanted?host=a.b", 5))[0], 405)
        self.assertEqual((await ask(reactor, path, "POST", "/reload", 5))[0], 404)


class AskTests(_SocketDir):
    async def test_nothing_listening_is_refused(self) -> None:
        path = os.path.join(self.dir, "dead.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(path)  # the file of a process gone: bound, not listening
        before = failures("status", "refused")
        with self.assertRaises(ChannelRefused) as caught:
            await ask(reactor, path, "GET", "/status", 2)
        self.assertIn("dead.sock", str(caught.exception))
        self.assertEqual(failures("status", "refused"), before + 1)

    async def test_no_socket_file_is_refused(self) -> None:
        with self.assertRaises(ChannelRefused):
            await ask(reactor, os.path.join(self.dir, "none.sock"), "POST", "/reload", 2)

    async def test_no_answer_in_time_is_a_timeout(self) -> None:
        path = os.path.join(self.dir, "hung.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(path)
        listener.listen(8)  # accepts into its queue, never answers: a hung worker
        before = failures("metrics", "timeout")
        started = reactor.seconds()
        with self.assertRaises(ChannelTimeout) as caught:
            await ask(reactor, path, "GET", "/metrics", 0.3)
        self.assertLess(reactor.seconds() - started, 1.2)
        self.assertIn("no answer within 0.3s", str(caught.exception))
        self.assertEqual(failures("metrics", "timeout"), before + 1)

    async def test_json_that_is_not_is_an_error(self) -> None:
        path = os.path.join(self.dir, "liar.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(path)
        listener.listen(8)

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 5\r\nConnection: close\r\n\r\n{oops"
                )

        served = deferToThread(answer)
        with self.assertRaises(ChannelError) as caught:
            await ask(reactor, path, "GET", "/status", 5)
        await served
        self.assertIn("not JSON", str(caught.exception))


class _Store:
    def __init__(self) -> None:
        self.given_up: list[str] = []

    def give_up(self, host: str) -> None:
        self.given_up.append(host)


class WorkerLinkTests(_SocketDir):
    def setUp(self) -> None:
        super().setUp()
        self.clock = task.Clock()
        self.store = _Store()
        self.asked: list[str] = []
        self.coming: dict[str, bool | None] = {}

        def want(host: str) -> bool | None:
            self.asked.append(host)
            return self.coming.get(host, False)

        self.control = self.serve(control_site(want), "control.sock")

    def released(self, count: int) -> Callable[[], bool]:
        return lambda: len(self.store.given_up) == count

    def link(self, control: str | None = None) -> WorkerLink:
        return WorkerLink(reactor, control or self.control, self.store, clock=self.clock)

    async def test_a_host_is_asked_once_and_held_meanwhile(self) -> None:
        self.coming["a.example.com"] = True
        link = self.link()
        self.assertIsNone(link.want("a.example.com"))
        self.assertIsNone(link.want("a.example.com"))  # still in flight: not asked again
        await until(lambda: link.want("a.example.com") is not None)
        self.assertIs(link.want("a.example.com"), True)
        self.assertEqual(self.asked, ["a.example.com"])
        self.assertEqual(self.store.given_up, [])

    async def test_an_answer_is_remembered_for_a_minute(self) -> None:
        self.coming["a.example.com"] = True
        link = self.link()
        link.want("a.example.com")
        await until(lambda: link.want("a.example.com") is not None)
        self.clock.advance(59)
        self.assertIs(link.want("a.example.com"), True)
        self.assertEqual(len(self.asked), 1)
        self.clock.advance(1)
        self.assertIsNone(link.want("a.example.com"))  # asked anew
        await until(lambda: len(self.asked) == 2)

    async def test_a_no_releases_the_held_handshakes(self) -> None:
        before = cert_answers("declined")
        link = self.link()
        self.assertIsNone(link.want("b.example.com"))
        await until(lambda: bool(self.store.given_up))
        self.assertEqual(self.store.given_up, ["b.example.com"])
        self.assertIs(link.want("b.example.com"), False)
        self.assertEqual(cert_answers("declined"), before + 1)

    async def test_a_maybe_counts_as_coming(self) -> None:
        self.coming["c.example.com"] = None
        link = self.link()
        link.want("c.example.com")
        await until(lambda: link.want("c.example.com") is not None)
        self.assertIs(link.want("c.example.com"), True)
        self.assertEqual(self.store.given_up, [])

    async def test_a_failed_call_is_a_no_for_a_minute_logged_once(self) -> None:
        said: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "lchat.workers":
                said.append(event["log_format"])

        globalLogPublisher.addObserver(cast(Any, observe))
        self.addCleanup(globalLogPublisher.removeObserver, cast(Any, observe))
        before = cert_answers("failed")
        link = self.link(os.path.join(self.dir, "gone.sock"))
        link.want("a.example.com")
        link.want("b.example.com")
        await until(lambda: len(self.store.given_up) == 2)
        self.assertEqual(sorted(self.store.given_up), ["a.example.com", "b.example.com"])
        self.assertIs(link.want("a.example.com"), False)
        self.assertEqual(cert_answers("failed"), before + 2)
        self.assertEqual(len(said), 1)
        self.assertIn("cannot ask the control process", said[0])
        self.clock.advance(60)
        self.assertIsNone(link.want("a.example.com"))  # asked again after the minute
        await until(lambda: len(self.store.given_up) == 3)
        self.assertEqual(len(said), 1)

    async def test_a_garbled_answer_is_a_failure(self) -> None:
        # Something else listens where control should: its 404 is no answer.
        elsewhere = self.serve(worker_site(lambda r: {}, lambda: {}, dict, bytes), "w.sock")
        link = self.link(elsewhere)
        link.want("a.example.com")
        await until(lambda: bool(self.store.given_up))
        self.assertIs(link.want("a.example.com"), False)

    async def test_memory_is_bounded(self) -> None:
        link = WorkerLink(reactor, self.control, self.store, clock=self.clock, capacity=3)
        for n in range(5):
            link.want(f"h{n}.example.com")
            await until(self.released(n + 1))  # each answered "no"
        self.assertEqual(len(self.asked), 5)
        self.assertIs(link.want("h4.example.com"), False)  # remembered
        self.assertEqual(len(self.asked), 5)
        self.assertIsNone(link.want("h0.example.com"))  # forgotten: asked again
        await until(lambda: len(self.asked) == 6)

    async def test_too_many_questions_in_flight_are_not_asked(self) -> None:
        link = WorkerLink(reactor, self.control, self.store, clock=self.clock, capacity=2)
        before = cert_answers("busy")
        self.assertIsNone(link.want("a.example.com"))
        self.assertIsNone(link.want("b.example.com"))
        self.assertIs(link.want("c.example.com"), False)
        self.assertEqual(cert_answers("busy"), before + 1)
        await until(lambda: len(self.store.given_up) == 2)


class NamesTests(unittest.SynchronousTestCase):
    def test_every_call_has_a_label(self) -> None:
        self.assertEqual(
            sorted(workerchannel.CALLS.values()),
            ["cert-wanted", "metrics", "reload", "rescan", "status", "version"],
        )

"""The reference bot sidecar: its schedule on a task.Clock, its clients in-process, and the real
sidecar process beside a real space process (through a recording proxy that sees every request)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from email.utils import formatdate
from typing import Any

from attrs import define, field
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint, UNIXClientEndpoint, UNIXServerEndpoint
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import Clock, deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import resource, server

from lchat import unixhttp
from lchat.reactors import installed
from lchat.space import sidecar
from lchat.space.sidecar import STOP_GRACE, Sidecar, StateFile, initial_due, next_slot, retry_after
from lchat.space.sidecar_client import (
    SIDECAR_HEADER,
    RequestFailed,
    UnixClient,
    URLClient,
    marked,
)
from lchat.space.sidecar_config import BaseURL, ConfigError, SidecarConfig
from lchat.unixhttp import Response
from tests.test_space import ADMIN, BOT, REPO, SpaceProcess

reactor = installed()


def listen_tcp(factory: IProtocolFactory) -> Deferred[IListeningPort]:
    """``factory`` on a free loopback port."""
    return TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)


def port_of(listening: IListeningPort) -> int:
    """The port a loopback listener took."""
    address = listening.getHost()
    assert isinstance(address, IPv4Address)
    return address.port


T0 = 1_700_000_000.25  # "now" for the clock tests (not a whole second on purpose)
HOST = "t.example"


# -- the schedule, on a task.Clock ---------------------------------------------------------------


@define
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    answer: Deferred[Response] = field(factory=Deferred)

    def json(self) -> Any:
        return json.loads(self.body)


Responder = Callable[[Call], Response | Exception | None]  # None: leave it pending


class FakeClient:
    """Records each request; answers through ``responder`` or leaves it pending (``call.answer``)."""

    host = HOST

    def __init__(self, clock: Clock, responder: Responder | None = None) -> None:
        self.clock = clock
        self.calls: list[Call] = []
        self.responder = responder

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        body: bytes = b"",
        timeout: float = 10.0,  # noqa: ASYNC109 -- the Client protocol's signature
    ) -> Response:
        call = Call(method, path, dict(headers), body, self.clock.seconds())
        self.calls.append(call)
        if self.responder is not None:
            outcome = self.responder(call)
            if isinstance(outcome, Exception):
                raise outcome
            if outcome is not None:
                return outcome
        return await call.answer

    def endpoint(self) -> IStreamClientEndpoint:
        raise NotImplementedError

    def target(self, path: str) -> str:
        return path

    def posts(self) -> list[Call]:
        return [c for c in self.calls if c.path.endswith("/messages")]

    def reports(self) -> list[Call]:
        return [c for c in self.calls if c.path == "/api/charter-next-due"]


def ok(call: Call) -> Response:
    if call.path == "/api/charter-next-due":
        return Response(204, {}, b"")
    return Response(201, {}, b'{"id": %d}' % len(call.body))


def status(code: int, retry: str | None = None) -> Response:
    return Response(code, {"retry-after": retry} if retry else {}, b'{"error": "no"}')


class ScheduleTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="sc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.clock = Clock()
        self.clock.advance(T0)
        self.state = StateFile(os.path.join(self.dir, "space.db-bot.json"))

    def config(self, **kw: Any) -> SidecarConfig:
        values: dict[str, Any] = {
            "token": BOT,
            "db": os.path.join(self.dir, "space.db"),
            "host": HOST,
            "socket": "/nonexistent",
            "every": 60,
            "room": "r1",
        }
        return SidecarConfig(**(values | kw))

    def make(
        self, responder: Responder | None = ok, connect: Any = None, **kw: Any
    ) -> tuple[Sidecar, FakeClient]:
        client = FakeClient(self.clock, responder)
        bot = Sidecar(self.clock, self.config(**kw), client, self.state, connect)
        return bot, client

    def saved(self) -> int | None:
        with open(self.state.path) as f:
            return json.load(f)["next_run"]

    def stop(self, bot: Sidecar) -> Deferred[None]:
        return Deferred.fromCoroutine(bot.stop())

    def test_fresh_start_runs_one_period_later(self) -> None:
        bot, client = self.make()
        bot.start()
        first = int(T0) + 1 + 60
        self.assertEqual((bot.next_run, self.saved(), bot.reported), (first, first, first))
        [report] = client.calls
        self.assertEqual(report.method, "POST")
        self.assertEqual(report.json(), {"due": first})
        self.assertEqual(report.headers["Authorization"], f"Bearer {BOT}")

        self.clock.advance(first - self.clock.seconds() - 0.01)
        self.assertEqual(client.posts(), [], "not before its time")
        self.clock.advance(0.01)
        [post] = client.posts()
        self.assertEqual((post.path, post.at), ("/api/rooms/r1/messages", first))
        self.assertNotIn("Authorization", post.headers, "the bot token goes only where needed")
        self.assertIn("scheduled run", post.json()["body"])
        self.assertEqual((bot.next_run, self.saved(), bot.reported), (first + 60,) * 3)
        self.assertEqual(client.reports()[-1].json(), {"due": first + 60})

        self.clock.pump([1] * 60 * 3)
        self.assertEqual([c.at for c in client.posts()], [first + 60 * k for k in range(4)])
        self.assertEqual(bot.runs, 4)

    def test_message_and_no_room(self) -> None:
        bot, client = self.make(message="good morning")
        bot.start()
        self.clock.advance(61)
        self.assertEqual(client.posts()[0].json(), {"body": "good morning"})

        self.state = StateFile(os.path.join(self.dir, "other.json"))
        bot, client = self.make(room=None)
        bot.start()  # at T0 + 61.25: runs at T0 + 122, 182, 242
        self.clock.pump([1] * (60 * 3 + 1))
        self.assertEqual(client.posts(), [], "no room: nothing is posted")
        self.assertEqual(bot.runs, 3, "but the schedule keeps going")
        self.assertEqual(client.reports()[-1].json(), {"due": bot.next_run})

    def test_missed_periods_run_once_on_start(self) -> None:
        due = int(T0) - 5 * 60 - 7  # five and a bit periods ago
        self.state.save(due)
        bot, client = self.make()
        bot.start()
        self.assertEqual(len(client.posts()), 1, "one catch-up run, at once")
        expected = due + 6 * 60  # the grid continues: the first slot after now
        self.assertGreater(expected, T0)
        self.assertEqual((bot.next_run, self.saved(), bot.reported), (expected,) * 3)
        self.clock.advance(expected - T0 - 0.5)
        self.assertEqual(len(client.posts()), 1, "not once per missed period")
        self.clock.advance(0.5)
        self.assertEqual(len(client.posts()), 2)

    def test_restart_keeps_the_schedule(self) -> None:
        bot, client = self.make()
        bot.start()
        due = bot.next_run
        self.clock.advance(30)
        self.successResultOf(self.stop(bot))
        self.assertEqual(self.clock.getDelayedCalls(), [])

        self.clock.advance(10)  # stopped for a while, but not past the due time
        bot, client = self.make()
        bot.start()
        self.assertEqual((bot.next_run, self.saved()), (due, due), "not reset by the restart")
        self.assertEqual([c.json() for c in client.reports()], [{"due": due}], "reported anew")
        self.clock.advance(due - self.clock.seconds())
        self.assertEqual(len(client.posts()), 1)

    def test_far_future_state_is_clamped(self) -> None:
        self.state.save(int(T0) + 100 * 60)  # e.g. LCHAT_BOT_EVERY was shortened
        bot, _ = self.make()
        bot.start()
        self.assertEqual(bot.next_run, int(T0) + 1 + 60)

    def test_unreadable_state_starts_afresh(self) -> None:
        for junk in (b"{", b"[]", b'{"next_run": "5"}', b'{"next_run": -1}', b"\xff"):
            with open(self.state.path, "wb") as f:
                f.write(junk)
            bot, _ = self.make()
            bot.start()
            self.assertEqual(bot.next_run, int(T0) + 1 + 60, junk)
            self.assertEqual(self.saved(), bot.next_run, "rewritten, valid")
            self.successResultOf(self.stop(bot))

    def test_state_is_written_atomically(self) -> None:
        self.state.save(5)
        self.state.save(6)
        self.assertEqual(os.listdir(self.dir), ["space.db-bot.json"], "no temporary files left")
        self.assertEqual(self.state.load(), 6)
        broken = StateFile(os.path.join(self.dir, "missing-dir", "x.json"))
        self.assertRaises(OSError, broken.save, 1)
        self.assertIsNone(broken.load())

    def test_unwritable_state_does_not_stop_the_bot(self) -> None:
        self.state = StateFile(os.path.join(self.dir, "missing-dir", "x.json"))
        bot, client = self.make()
        bot.start()
        self.clock.advance(61)
        self.assertEqual(len(client.posts()), 1)
        self.assertEqual(len(self.flushLoggedErrors()), 0)

    def test_report_retries_with_capped_backoff(self) -> None:
        failures = 10
        calls = 0

        def flaky(call: Call) -> Response | Exception:
            nonlocal calls
            calls += 1
            return RequestFailed("nothing listening") if calls <= failures else ok(call)

        bot, client = self.make(flaky, every=3600)
        bot.start()
        self.clock.pump([0.5] * 2 * 600)
        gaps = [b.at - a.at for a, b in zip(client.calls, client.calls[1:], strict=False)]
        self.assertEqual(gaps, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60])
        self.assertEqual(bot.reported, bot.next_run)
        self.assertEqual(len(client.calls), failures + 1, "no calls after the success")

    def test_retry_after_is_honoured_and_capped(self) -> None:
        answers = [
            status(503, "5"),
            status(503, "3600"),
            status(503, formatdate(T0 + 85.75, usegmt=True)),
            status(502),
        ]

        def busy(call: Call) -> Response:
            return answers.pop(0) if answers else ok(call)

        bot, client = self.make(busy, every=3600)
        bot.start()
        self.clock.pump([0.25] * 4 * 200)
        gaps = [b.at - a.at for a, b in zip(client.calls, client.calls[1:], strict=False)]
        # 5 (asked), 60 (3600 asked, capped), an HTTP-date 20.75 s ahead, 8 (the backoff's own)
        self.assertEqual(gaps, [5, 60, 20.75, 8])
        self.assertEqual(bot.reported, bot.next_run)

    def test_refused_report_is_not_retried(self) -> None:
        bot, client = self.make(lambda call: status(403), every=3600)
        bot.start()
        self.clock.pump([1] * 600)
        self.assertEqual(len(client.calls), 1)

    def test_post_retried_then_abandoned_at_the_next_slot(self) -> None:
        def down(call: Call) -> Response:
            return status(500) if call.path.endswith("/messages") else ok(call)

        bot, client = self.make(down, every=10)
        bot.start()
        due = bot.next_run
        self.clock.advance(due - T0)
        self.clock.pump([0.5] * 40)
        attempts = [c.at - due for c in client.posts()]
        # 0, 1, 3, 7; the next wait (8 s) would reach the next slot (10 s): give up, move on.
        self.assertEqual(attempts[:4], [0, 1, 3, 7])
        self.assertEqual(attempts[4], 10, "the next run starts on time")
        self.assertGreaterEqual(bot.runs, 2)

    def test_post_refused_is_not_retried(self) -> None:
        def refuse(call: Call) -> Response:
            return status(400) if call.path.endswith("/messages") else ok(call)

        bot, client = self.make(refuse)
        bot.start()
        due = bot.next_run
        self.clock.advance(due - T0 + 59)
        self.assertEqual(len(client.posts()), 1)
        self.assertEqual((bot.runs, bot.next_run), (1, due + 60))

    def test_stop_while_retrying_is_immediate(self) -> None:
        bot, _ = self.make(lambda call: RequestFailed("down"))
        bot.start()
        self.clock.advance(1.5)
        stopped = self.stop(bot)
        self.successResultOf(stopped)  # no waiting on the clock at all
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertNotEqual(bot.reported, bot.next_run)

    def test_stop_interrupts_a_stuck_run_without_advancing(self) -> None:
        def hang(call: Call) -> Response | None:
            return None if call.path.endswith("/messages") else ok(call)

        bot, client = self.make(hang)
        bot.start()
        due = bot.next_run
        self.clock.advance(due - T0)
        self.assertEqual(len(client.posts()), 1)
        stopped = self.stop(bot)
        self.assertNoResult(stopped)
        self.clock.advance(STOP_GRACE)
        self.successResultOf(stopped)
        self.assertEqual((bot.next_run, self.saved(), bot.runs), (due, due, 0), "not advanced")

        bot, client = self.make()
        bot.start()
        self.assertEqual(len(client.posts()), 1, "so it runs again on the next start")

    def test_stop_lets_an_inflight_run_finish_and_reports(self) -> None:
        bot, client = self.make(None)  # every request pending
        bot.start()
        client.calls[0].answer.callback(status(204))
        due = bot.next_run
        self.clock.advance(due - T0)
        [post] = client.posts()
        stopped = self.stop(bot)
        self.clock.advance(1)
        post.answer.callback(Response(201, {}, b'{"id": 7}'))
        self.assertEqual((bot.runs, bot.next_run, self.saved()), (1, due + 60, due + 60))
        self.assertNoResult(stopped)
        final = client.calls[-1]
        self.assertEqual(final.json(), {"due": due + 60}, "one last report before exiting")
        final.answer.callback(status(204))
        self.successResultOf(stopped)
        self.assertEqual(bot.reported, due + 60)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_listener_reconnects_with_backoff(self) -> None:
        attempts: list[float] = []
        handles: list[FakeSocket] = []

        async def connect(path: str, on_text: Callable[[str], None]) -> FakeSocket:
            attempts.append(self.clock.seconds())
            self.assertEqual(path, "/api/rooms/r1/ws")
            if len(attempts) <= 2:
                raise RequestFailed("refused")
            handles.append(FakeSocket(on_text))
            return handles[-1]

        bot, _ = self.make(connect=connect, listen=True)
        bot.start()
        self.clock.pump([0.5] * 10)
        self.assertEqual([a - T0 for a in attempts], [0, 1, 3])
        handles[0].on_text('{"id": 1, "room": "r1", "body": "hi"}')
        handles[0].on_text("not json")
        handles[0].closed.callback(None)  # the space went away
        self.clock.advance(1)
        self.assertEqual(len(attempts), 4, "reconnected after the initial backoff")
        self.successResultOf(self.stop(bot))
        self.assertTrue(handles[1].was_closed)
        self.assertEqual(self.clock.getDelayedCalls(), [])


@define
class FakeSocket:
    on_text: Callable[[str], None]
    closed: Deferred[None] = field(factory=Deferred)
    was_closed: bool = False

    def close(self) -> None:
        self.was_closed = True
        if not self.closed.called:
            self.closed.callback(None)


class PureTests(SynchronousTestCase):
    def test_next_slot(self) -> None:
        self.assertEqual(next_slot(100, 10, 50.0), 100, "ahead: unchanged")
        self.assertEqual(next_slot(100, 10, 100.0), 110)
        self.assertEqual(next_slot(100, 10, 109.9), 110)
        self.assertEqual(next_slot(100, 10, 110.0), 120)
        self.assertEqual(next_slot(100, 10, 1000.5), 1010)

    def test_initial_due(self) -> None:
        self.assertEqual(initial_due(None, 10, 100.2), 111)
        self.assertEqual(initial_due(50, 10, 100.2), 50, "overdue: kept, runs at once")
        self.assertEqual(initial_due(105, 10, 100.2), 105)
        self.assertEqual(initial_due(111, 10, 100.2), 111)
        self.assertEqual(initial_due(112, 10, 100.2), 111, "clamped to one period ahead")

    def test_retry_after(self) -> None:
        self.assertEqual(retry_after("7", 0), 7)
        self.assertEqual(retry_after(" 0 ", 0), 0)
        self.assertEqual(retry_after(formatdate(1000.0, usegmt=True), 990), 10)
        self.assertEqual(retry_after(formatdate(1000.0, usegmt=True), 2000), 0)
        for junk in (None, "", "-1", "1.5", "soon", "99999999999"):
            self.assertIsNone(retry_after(junk, 0), junk)

    def test_backoff(self) -> None:
        b = sidecar.BACKOFF.delays()
        self.assertEqual([b.next() for _ in range(9)], [1, 2, 4, 8, 16, 32, 60, 60, 60])
        b.reset()
        self.assertEqual((b.next(30), b.next(), b.next(1000)), (30, 2, 60))

    def test_marked(self) -> None:
        self.assertEqual(
            marked({"x-lchat-SIDECAR": "0", "A": "b"}), {"A": "b", SIDECAR_HEADER: "1"}
        )

    def test_config(self) -> None:
        base = {"LCHAT_BOT_TOKEN": "tok", "LCHAT_DB": "/d/h.db", "LCHAT_SOCKET": "/r/h.sock"}
        c = SidecarConfig.from_env(base)
        self.assertEqual(
            (c.token, c.socket, c.url, c.every, c.room, c.listen, c.host),
            ("tok", "/r/h.sock", None, 3600, None, False, "space"),
        )
        self.assertEqual(c.state_path, "/d/h.db-bot.json")
        c = SidecarConfig.from_env(
            base
            | {
                "LCHAT_SIDECAR_URL": "https://127.0.0.1:8443/pre/",
                "LCHAT_HOST": "Chat.Example.com",
                "LCHAT_BOT_EVERY": "5",
                "LCHAT_BOT_ROOM": "news",
                "LCHAT_BOT_LISTEN": "1",
            }
        )
        self.assertEqual(c.url, BaseURL("https", "127.0.0.1", 8443, "/pre"))
        self.assertEqual((c.host, c.every, c.room, c.listen), ("chat.example.com", 5, "news", True))
        self.assertEqual(
            BaseURL.parse("http://[::1]/").__str__(), "http://[::1]:80", "IPv6, default port"
        )

        bad: list[tuple[dict[str, str], str]] = [
            ({"LCHAT_BOT_TOKEN": ""}, "LCHAT_BOT_TOKEN"),
            ({"LCHAT_BOT_TOKEN": "  "}, "LCHAT_BOT_TOKEN"),
            ({"LCHAT_DB": ""}, "LCHAT_DB"),
            ({"LCHAT_SOCKET": ""}, "LCHAT_SOCKET"),
            ({"LCHAT_BOT_EVERY": "0"}, "LCHAT_BOT_EVERY"),
            ({"LCHAT_BOT_EVERY": "1.5"}, "LCHAT_BOT_EVERY"),
            ({"LCHAT_BOT_ROOM": "bad room"}, "LCHAT_BOT_ROOM"),
            ({"LCHAT_BOT_LISTEN": "1"}, "LCHAT_BOT_ROOM"),
            ({"LCHAT_BOT_LISTEN": "maybe"}, "LCHAT_BOT_LISTEN"),
            ({"LCHAT_HOST": "not a host"}, "LCHAT_HOST"),
            ({"LCHAT_SIDECAR_URL": "http://router:8080"}, "LCHAT_HOST"),
            ({"LCHAT_SIDECAR_URL": "ftp://x", "LCHAT_HOST": HOST}, "LCHAT_SIDECAR_URL"),
            ({"LCHAT_SIDECAR_URL": "http://:80", "LCHAT_HOST": HOST}, "LCHAT_SIDECAR_URL"),
            ({"LCHAT_SIDECAR_URL": "http://x:99999", "LCHAT_HOST": HOST}, "LCHAT_SIDECAR_URL"),
            ({"LCHAT_SIDECAR_URL": "http://u:p@x/", "LCHAT_HOST": HOST}, "LCHAT_SIDECAR_URL"),
        ]
        for change, name in bad:
            with self.assertRaises(ConfigError, msg=change) as caught:
                SidecarConfig.from_env(base | change)
            self.assertIn(name, str(caught.exception), change)


# -- the clients, against in-process servers -----------------------------------------------------


class _Echo(resource.Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bytes, dict[bytes, Sequence[bytes]]]] = []

    def render(self, request: server.Request) -> bytes:
        headers = {k.lower(): v for k, v in request.requestHeaders.getAllRawHeaders()}
        self.seen.append((request.uri, headers))
        request.setResponseCode(201)
        return b'{"ok": true}'


class ClientTests(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="scc", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.echo = _Echo()
        self.site = server.Site(self.echo)
        self.site.noisy = False

    def check(self, expected_uri: bytes) -> None:
        [(uri, headers)] = self.echo.seen
        self.assertEqual(uri, expected_uri)
        self.assertEqual(headers[b"x-lchat-sidecar"], [b"1"], "the marker, once, never forged")
        self.assertEqual(headers[b"host"], [HOST.encode()])
        self.assertEqual(headers[b"authorization"], [b"Bearer x"])

    async def test_unix_client(self) -> None:
        path = os.path.join(self.dir, "s.sock")
        port = await UNIXServerEndpoint(reactor, path).listen(self.site)
        self.addCleanup(port.stopListening)
        client = UnixClient(reactor, path, HOST)
        resp = await client.request(
            "POST",
            "/api/x",
            headers={"Authorization": "Bearer x", "X-Lchat-Sidecar": "0"},
            body=b"{}",
        )
        self.assertEqual((resp.status, resp.body), (201, b'{"ok": true}'))
        self.check(b"/api/x")
        missing = UnixClient(reactor, os.path.join(self.dir, "none.sock"), HOST)
        with self.assertRaises(RequestFailed):
            await missing.request("GET", "/", headers={})

    async def test_url_client(self) -> None:
        port = await listen_tcp(self.site)
        self.addCleanup(port.stopListening)
        base = BaseURL.parse(f"http://127.0.0.1:{port_of(port)}/pre")
        client = URLClient(reactor, base, HOST)
        resp = await client.request(
            "POST",
            "/api/x",
            headers={"authorization": "Bearer x", "x-lchat-sidecar": "forged"},
            body=b"{}",
        )
        self.assertEqual((resp.status, resp.body), (201, b'{"ok": true}'))
        self.check(b"/pre/api/x")
        await maybeDeferred(port.stopListening)
        with self.assertRaises(RequestFailed):
            await client.request("GET", "/", headers={})


# -- the real processes --------------------------------------------------------------------------


@define
class Head:
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]

    def get(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


class Recorder:
    """A byte-level proxy in front of the space that records every request head it forwards.

    ``faults`` are canned responses, each answering the first request of one new connection
    instead of the space.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.heads: list[Head] = []
        self.faults: list[bytes] = []

    def factory(self) -> Factory:
        return Factory.forProtocol(lambda: _Recording(self))


class _Pipe(Protocol):
    def __init__(self, downstream: Protocol) -> None:
        self.downstream = downstream

    def dataReceived(self, data: bytes) -> None:
        assert self.downstream.transport is not None
        self.downstream.transport.write(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.downstream.transport is not None:
            self.downstream.transport.loseConnection()


class _Recording(Protocol):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.buffer = b""
        self.skip = 0
        self.upgraded = False
        self.started = False
        self.pipe: _Pipe | None = None
        self.queued: list[bytes] = []
        self.closed = False

    def dataReceived(self, data: bytes) -> None:
        seen = len(self.recorder.heads)
        self._parse(data)
        if not self.started and len(self.recorder.heads) > seen:
            self.started = True
            if self.recorder.faults:
                assert self.transport is not None
                self.transport.write(self.recorder.faults.pop(0))
                self.transport.loseConnection()
                return
            endpoint = UNIXClientEndpoint(reactor, self.recorder.upstream)
            connecting = endpoint.connect(Factory.forProtocol(lambda: _Pipe(self)))
            connecting.addCallbacks(self._connected, self._unreachable)
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.write(data)
        else:
            self.queued.append(data)

    def _connected(self, pipe: _Pipe) -> None:
        self.pipe = pipe
        assert pipe.transport is not None
        if self.closed:
            pipe.transport.loseConnection()
            return
        for data in self.queued:
            pipe.transport.write(data)
        self.queued = []

    def _unreachable(self, failure: Failure) -> None:
        if self.transport is not None:
            self.transport.loseConnection()

    def _parse(self, data: bytes) -> None:
        buf = self.buffer + data
        while buf and not self.upgraded:
            if self.skip:
                n = min(self.skip, len(buf))
                self.skip -= n
                buf = buf[n:]
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head, buf = buf[:end], buf[end + 4 :]
            lines = head.split(b"\r\n")
            method, path, _ = lines[0].split(b" ", 2)
            headers = [
                (k.strip().lower(), v.strip()) for k, _, v in (x.partition(b":") for x in lines[1:])
            ]
            self.recorder.heads.append(Head(method, path, headers))
            lengths = [v for k, v in headers if k == b"content-length"]
            self.skip = int(lengths[0]) if lengths else 0
            self.upgraded = any(k == b"upgrade" for k, _ in headers)
        self.buffer = buf if not self.upgraded else b""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = True
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.loseConnection()


SERVICE_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)
BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class SidecarProcessTests(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="scp", dir="/tmp")  # short: unix socket paths
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.sock = os.path.join(self.dir, "s.sock")
        self.db = os.path.join(self.dir, "space.db")
        self.state = self.db + "-bot.json"
        self.recorder = Recorder(self.sock)
        self.front = os.path.join(self.dir, "front.sock")  # the recorder, in front of the space
        port = reactor.listenUNIX(self.front, self.recorder.factory())
        self.addCleanup(port.stopListening)

    # -- helpers ---------------------------------------------------------------------------------

    def env(self, **overrides: str | None) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
        env |= {"LCHAT_HOST": HOST, "LCHAT_DB": self.db, "LCHAT_BOT_TOKEN": BOT}
        for name, value in overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def spawn(self, module: str, env: dict[str, str]) -> SpaceProcess:
        proc = SpaceProcess()
        reactor.spawnProcess(
            proc, sys.executable, [sys.executable, "-m", module], env=env, path=str(REPO)
        )
        self.addCleanup(self.kill, proc)
        return proc

    async def kill(self, proc: SpaceProcess) -> None:
        if proc.running:
            proc.signal("KILL")
            await proc.ended

    async def start_space(self) -> SpaceProcess:
        proc = self.spawn(
            "lchat.space",
            self.env(LCHAT_SOCKET=self.sock, LCHAT_ADMIN_TOKEN=ADMIN),
        )

        async def ready() -> bool:
            if not proc.running:
                self.fail(f"space exited {proc.code}: {proc.stderr.decode()}")
            try:
                return (await self.api("GET", "/api/version"))[0] == 200
            except unixhttp.UnixHTTPError:
                return False

        await self.poll(ready, "the space to answer", within=20)
        return proc

    def start_sidecar(self, **overrides: str | None) -> SpaceProcess:
        return self.spawn(
            "lchat.space.sidecar", self.env(**({"LCHAT_SOCKET": self.front} | overrides))
        )

    async def stop(self, proc: SpaceProcess) -> None:
        """SIGTERM: exit 0, promptly."""
        began = time.monotonic()
        proc.signal("TERM")
        self.assertEqual(await proc.ended, 0, proc.stderr.decode())
        self.assertLess(time.monotonic() - began, STOP_GRACE + 2)
        self.assertIn(f"sidecar {HOST} stopped".encode(), proc.stderr)

    async def poll(
        self, check: Callable[[], Awaitable[bool] | bool], what: str, within: float = 15
    ) -> None:
        deadline = time.monotonic() + within
        while True:
            result = check()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}")
            await deferLater(reactor, 0.05)

    async def api(self, method: str, path: str, token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = await unixhttp.request(reactor, self.sock, method, path, headers=headers)
        return resp.status, json.loads(resp.body) if resp.body else None

    async def next_due(self) -> int:
        code, reply = await self.api("GET", "/api/next-due", ADMIN)
        self.assertEqual(code, 200)
        return int(reply["due"])

    async def messages(self, room: str = "r1") -> list[dict[str, Any]]:
        code, reply = await self.api("GET", f"/api/rooms/{room}/messages")
        self.assertEqual(code, 200)
        return list(reply["messages"])

    def saved(self) -> int:
        with open(self.state) as f:
            return int(json.load(f)["next_run"])

    def logged(self, proc: SpaceProcess, text: str) -> Callable[[], bool]:
        return lambda: text.encode() in proc.stderr

    def assert_all_marked(self) -> None:
        self.assertTrue(self.recorder.heads)
        for head in self.recorder.heads:
            self.assertEqual(head.get(b"x-lchat-sidecar"), [b"1"], head)
            self.assertEqual(head.get(b"host"), [HOST.encode()], head)
            if head.path == b"/api/charter-next-due":
                self.assertEqual(head.get(b"authorization"), [f"Bearer {BOT}".encode()])
            else:
                self.assertEqual(head.get(b"authorization"), [], "the token only where needed")

    # -- tests -----------------------------------------------------------------------------------

    async def test_reports_posts_and_listens_every_request_marked(self) -> None:
        await self.start_space()
        proc = self.start_sidecar(LCHAT_BOT_EVERY="1", LCHAT_BOT_ROOM="r1", LCHAT_BOT_LISTEN="1")
        await self.poll(self.logged(proc, "listening to room r1"), "the websocket")

        async def due_reported() -> bool:
            return await self.next_due() > 0

        await self.poll(due_reported, "a charter report")

        async def three() -> bool:
            return len(await self.messages()) >= 3

        await self.poll(three, "three scheduled posts")
        posted = await self.messages()
        self.assertTrue(all(m["body"].startswith("scheduled run ") for m in posted), posted)
        times = [m["sent_at"] for m in posted]
        self.assertEqual(times, sorted(set(times)), "one post per period")
        await self.poll(
            self.logged(proc, f"heard message {posted[0]['id']} in r1"), "the listener to hear"
        )
        await self.stop(proc)

        text = proc.stderr.decode()
        self.assertIn(f"sidecar {HOST}: run for ", text)
        self.assertIn(f"posted message {posted[0]['id']} to r1", text)
        self.assertIn(f"sidecar {HOST}: reported next run ", text)
        self.assertGreaterEqual(len(await self.messages()), len(posted))
        self.assertGreater(self.saved(), times[-1] - 1)

        paths = {(h.method, h.path) for h in self.recorder.heads}
        self.assertIn((b"POST", b"/api/charter-next-due"), paths)
        self.assertIn((b"POST", b"/api/rooms/r1/messages"), paths)
        [upgrade] = [h for h in self.recorder.heads if h.path == b"/api/rooms/r1/ws"]
        self.assertEqual(upgrade.get(b"upgrade"), [b"websocket"])
        self.assert_all_marked()

    async def test_schedule_survives_restarts(self) -> None:
        await self.start_space()
        env: dict[str, str | None] = {"LCHAT_BOT_EVERY": "3600", "LCHAT_BOT_ROOM": "r1"}
        proc = self.start_sidecar(**env)
        await self.poll(self.logged(proc, "reported next run"), "the first report")
        due = await self.next_due()
        self.assertLess(time.time(), due)
        self.assertLessEqual(due, time.time() + 3602)
        self.assertEqual(self.saved(), due)
        await self.stop(proc)

        proc = self.start_sidecar(**env)  # as at the next wake
        await self.poll(self.logged(proc, f"reported next run {due}"), "the report after restart")
        self.assertEqual((await self.next_due(), self.saved()), (due, due), "not reset")
        await self.stop(proc)
        self.assertEqual(await self.messages(), [], "no run was due")

        # Slept through two periods and more: one run at start, then the grid goes on.
        missed = due - 2 * 3600 - 5
        StateFile(self.state).save(missed)
        proc = self.start_sidecar(**env)
        await self.poll(self.logged(proc, f"reported next run {due - 5}"), "the catch-up run")
        self.assertIn(b"overdue", proc.stderr)
        self.assertEqual(len(await self.messages()), 1)
        self.assertEqual((await self.next_due(), self.saved()), (due - 5, due - 5))
        await deferLater(reactor, 1.5)
        self.assertEqual(len(await self.messages()), 1, "once, not once per missed period")
        await self.stop(proc)
        self.assert_all_marked()

    async def test_through_a_url_with_host_header(self) -> None:
        await self.start_space()
        tcp = await listen_tcp(self.recorder.factory())
        self.addCleanup(tcp.stopListening)
        proc = self.start_sidecar(
            LCHAT_SIDECAR_URL=f"http://127.0.0.1:{port_of(tcp)}",
            LCHAT_SOCKET=os.path.join(self.dir, "unused.sock"),
            LCHAT_BOT_EVERY="1",
            LCHAT_BOT_ROOM="r1",
            LCHAT_BOT_LISTEN="1",
        )

        async def posted() -> bool:
            return len(await self.messages()) >= 1

        await self.poll(posted, "a post through the URL")
        await self.poll(self.logged(proc, "heard message"), "the listener to hear")
        self.assertGreater(await self.next_due(), 0)
        await self.stop(proc)
        self.assertIn(b"/api/rooms/r1/ws", [h.path for h in self.recorder.heads])
        self.assert_all_marked()

    async def test_waits_for_the_space_to_answer(self) -> None:
        proc = self.start_sidecar(LCHAT_SOCKET=self.sock)  # nothing listens there yet
        await self.poll(self.logged(proc, "retrying in"), "a failed report")
        self.assertIn(b"socket does not exist", proc.stderr)
        await self.start_space()

        async def reported() -> bool:
            return await self.next_due() > 0

        await self.poll(reported, "the report once the space answers")
        self.assertTrue(proc.running)
        await self.stop(proc)

    async def test_retries_5xx_honouring_retry_after(self) -> None:
        await self.start_space()
        self.recorder.faults = [SERVICE_UNAVAILABLE, BAD_GATEWAY]
        proc = self.start_sidecar()

        async def reported() -> bool:
            return await self.next_due() > 0

        await self.poll(reported, "the report after two failures")
        text = proc.stderr.decode()
        self.assertIn("reporting next run failed (HTTP 503); retrying in 2s", text)
        self.assertIn("reporting next run failed (HTTP 502); retrying in 2s", text)
        self.assertEqual(len(self.recorder.heads), 3)
        await self.stop(proc)
        self.assert_all_marked()

    async def test_sigterm_while_retrying_exits_promptly(self) -> None:
        proc = self.start_sidecar(LCHAT_SOCKET=self.sock)  # no space: backing off
        await self.poll(self.logged(proc, "retrying in 2s"), "the backoff")
        await self.stop(proc)
        self.assertIn(b"could not report next run", proc.stderr)

    async def test_refuses_to_start_without_a_token(self) -> None:
        for token in (None, ""):
            proc = self.start_sidecar(LCHAT_BOT_TOKEN=token)
            self.assertEqual(await proc.ended, 2)
            self.assertIn(b"LCHAT_BOT_TOKEN", proc.stderr)
            self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
        for name, value in [
            ("LCHAT_BOT_EVERY", "0"),
            ("LCHAT_DB", None),
            ("LCHAT_SIDECAR_URL", "ftp://x"),
        ]:
            proc = self.start_sidecar(**{name: value})
            self.assertEqual(await proc.ended, 2, name)
            self.assertIn(name.encode(), proc.stderr)
        self.assertIsNone(StateFile(self.state).load(), "nothing written")
        self.assertEqual(self.recorder.heads, [], "no request was made")

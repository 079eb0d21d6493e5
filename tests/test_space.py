"""The reference space server, end to end: a real child process, real unix sockets, real clients."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import socket
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectError
from twisted.internet.protocol import Factory, ProcessProtocol, Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from twisted.web.websocket import WebSocketClientEndpoint, WebSocketTransport
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import unix_connect
from zope.interface import implementer

import lchat
from lchat.reactors import installed
from lchat.space import store
from lchat.sqlite import migrate, write_transaction

reactor = installed()

REPO = Path(__file__).resolve().parents[1]
ADMIN = "admin-secret"
BOT = "bot-secret"
# websockets >= 14 warns unless the historical connect() behaviour is asked for explicitly.
WS_COMPAT: dict[str, Any] = (
    {"legacy": True} if "legacy" in inspect.signature(unix_connect).parameters else {}
)


def exists(path: str) -> bool:
    return os.path.exists(path)


def size(path: str) -> int:
    """Size of the file at `path`, 0 if there is none."""
    return os.path.getsize(path) if exists(path) else 0


class SpaceProcess(ProcessProtocol):
    def __init__(self) -> None:
        self.stderr = b""
        self.ended: Deferred[int | None] = Deferred()
        self.code: int | None = None
        self.running = True

    def signal(self, name: str) -> None:
        assert self.transport is not None
        self.transport.signalProcess(name)

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason: Failure) -> None:
        self.running = False
        self.code = getattr(reason.value, "exitCode", None)  # None when killed by a signal
        self.ended.callback(self.code)


@implementer(IAgentEndpointFactory)
class UnixEndpoints:
    """Every URL goes to the one unix socket (as the router's proxy does)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(reactor, self.path)


class WSClient:
    """A twisted.web.websocket client protocol that queues the JSON frames it receives."""

    def __init__(self) -> None:
        self.transport: WebSocketTransport | None = None
        self.frames: DeferredQueue[Any] = DeferredQueue()
        self.closed: Deferred[None] = Deferred()

    def negotiationStarted(self, transport: WebSocketTransport) -> None:
        self.transport = transport

    def negotiationFinished(self) -> None:
        pass

    def textMessageReceived(self, message: str) -> None:
        self.frames.put(json.loads(message))

    def bytesMessageReceived(self, data: bytes | bytearray) -> None:
        self.frames.put(data)

    def pongReceived(self, payload: bytes) -> None:
        pass

    def connectionLost(self, reason: Failure) -> None:
        self.closed.callback(None)

    def send(self, obj: object) -> None:
        assert self.transport is not None
        self.transport.sendTextMessage(obj if isinstance(obj, str) else json.dumps(obj))

    async def next(self, within: float = 5.0) -> Any:
        return await self.frames.get().addTimeout(within, reactor)


class RawClient(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(None)


class SpaceTests(TestCase):
    def setUp(self) -> None:
        # Short paths: a unix socket path must fit in ~100 bytes.
        self.dir = tempfile.mkdtemp(prefix="sp", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.sock = os.path.join(self.dir, "s.sock")
        self.db = os.path.join(self.dir, "space.db")
        self.pool = HTTPConnectionPool(reactor)
        self.addCleanup(self.pool.closeCachedConnections)
        self.procs: list[SpaceProcess] = []

    # -- helpers -------------------------------------------------------------------------------

    def spawn(self, **overrides: str | None) -> SpaceProcess:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
        env |= {
            "LCHAT_HOST": "t.example",
            "LCHAT_SOCKET": self.sock,
            "LCHAT_DB": self.db,
            "LCHAT_ADMIN_TOKEN": ADMIN,
            "LCHAT_BOT_TOKEN": BOT,
        }
        for name, value in overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        proc = SpaceProcess()
        reactor.spawnProcess(
            proc, sys.executable, [sys.executable, "-m", "lchat.space"], env=env, path=str(REPO)
        )
        self.addCleanup(self.kill, proc)
        self.procs.append(proc)
        return proc

    async def kill(self, proc: SpaceProcess) -> None:
        if proc.running:
            proc.signal("KILL")
            await proc.ended

    async def start(self, **overrides: str | None) -> SpaceProcess:
        proc = self.spawn(**overrides)

        async def ready() -> bool:
            if not proc.running:
                self.fail(f"space exited {proc.code}: {proc.stderr.decode()}")
            try:
                code, _ = await self.http("GET", "/api/version")
            except ConnectError:
                return False
            return code == 200

        await self.poll(ready, "the space to answer /api/version", within=20)
        return proc

    async def poll(
        self, check: Callable[[], Awaitable[bool] | bool], what: str, within: float = 10
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

    async def http(
        self,
        method: str,
        path: str,
        body: object = None,
        token: str | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        agent = Agent.usingEndpointFactory(reactor, UnixEndpoints(self.sock), pool=self.pool)
        headers = Headers()
        if token is not None:
            headers.addRawHeader(b"authorization", b"Bearer " + token.encode())
        if body is not None:
            raw = json.dumps(body).encode()
        producer = None if raw is None else FileBodyProducer(BytesIO(raw))
        response = await agent.request(
            method.encode(), b"http://space.test" + path.encode(), headers, producer
        )
        content = await readBody(response)
        if response.headers.hasHeader(b"content-type"):
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertTrue(content.endswith(b"}\n"), content)  # a line, as curl prints it
            return response.code, json.loads(content)
        return response.code, content

    async def next_due(self) -> int:
        code, reply = await self.http("GET", "/api/next-due", token=ADMIN)
        self.assertEqual(code, 200)
        return reply["due"]

    async def ws(self, room: str) -> WSClient:
        endpoint = WebSocketClientEndpoint(
            UnixEndpoints(self.sock), f"ws://space.test/api/rooms/{room}/ws"
        )
        client = WSClient()

        class OneClient:
            def buildProtocol(self, url: str) -> WSClient:
                return client

        await endpoint.connect(OneClient())

        async def close() -> None:
            if not client.closed.called:
                assert client.transport is not None
                client.transport.loseConnection()
                await client.closed

        self.addCleanup(close)
        return client

    # -- tests ---------------------------------------------------------------------------------

    async def test_version(self) -> None:
        await self.start(LCHAT_BUILD="b-42")
        code, reply = await self.http("GET", "/api/version")
        self.assertEqual((code, reply), (200, {"version": lchat.__version__, "build": "b-42"}))
        self.assertEqual((await self.http("POST", "/api/version", raw=b""))[0], 405, "wrong method")

    async def test_next_due_auth(self) -> None:
        await self.start()
        self.assertEqual(await self.next_due(), 0)
        self.assertEqual((await self.http("GET", "/api/next-due", token="wrong"))[0], 403)
        self.assertEqual((await self.http("GET", "/api/next-due", token=BOT))[0], 403)
        self.assertEqual((await self.http("GET", "/api/next-due"))[0], 403)

    async def test_fail_closed_without_tokens(self) -> None:
        await self.start(LCHAT_ADMIN_TOKEN=None, LCHAT_BOT_TOKEN="")
        for token in (None, "", ADMIN):
            self.assertEqual((await self.http("GET", "/api/next-due", token=token))[0], 403)
            code, _ = await self.http("POST", "/api/charter-next-due", {"due": 1}, token=token)
            self.assertEqual(code, 403)

    async def test_charter_next_due(self) -> None:
        await self.start()
        due = int(time.time()) + 600
        code, reply = await self.http("POST", "/api/charter-next-due", {"due": due}, token=BOT)
        self.assertEqual((code, reply), (204, b""))
        self.assertEqual(await self.next_due(), due)
        for token in ("wrong", ADMIN, None):
            code, _ = await self.http("POST", "/api/charter-next-due", {"due": 1}, token=token)
            self.assertEqual(code, 403)
        for bad in (b"{", b"[]", b'{"due": -1}', b'{"due": "5"}', b'{"due": true}', b"{}"):
            code, reply = await self.http("POST", "/api/charter-next-due", raw=bad, token=BOT)
            self.assertEqual(code, 400, bad)
            self.assertIn("error", reply)
        self.assertEqual(await self.next_due(), due, "a rejected report changes nothing")
        # A charter time in the past is ignored; 0 clears it.
        await self.http("POST", "/api/charter-next-due", {"due": due - 1200}, token=BOT)
        self.assertEqual(await self.next_due(), 0)

    async def test_post_and_list(self) -> None:
        await self.start()
        before = int(time.time())
        posted = []
        for room, body in [("r1", "one"), ("r2", "other"), ("r1", "two"), ("r1", "three")]:
            code, reply = await self.http("POST", f"/api/rooms/{room}/messages", {"body": body})
            self.assertEqual(code, 201)
            self.assertEqual((reply["room"], reply["body"]), (room, body))
            self.assertLessEqual(before, reply["sent_at"])
            posted.append(reply)
        r1 = [m for m in posted if m["room"] == "r1"]
        code, reply = await self.http("GET", "/api/rooms/r1/messages")
        self.assertEqual((code, reply), (200, {"messages": r1}))
        code, reply = await self.http("GET", f"/api/rooms/r1/messages?after={r1[0]['id']}&limit=1")
        self.assertEqual(reply["messages"], r1[1:2])
        code, reply = await self.http("GET", "/api/rooms/empty/messages")
        self.assertEqual((code, reply), (200, {"messages": []}))

    async def test_ids_are_never_reused_after_losing_the_last_writes(self) -> None:
        """kill -9 and a restore from a copy that lags (the documented replication window): the
        lost messages' ids, which clients may hold, are never given to new messages."""
        await self.start()
        for body in ("kept-1", "kept-2"):
            self.assertEqual(
                (await self.http("POST", "/api/rooms/r/messages", {"body": body}))[0], 201
            )
        lagging = os.path.join(self.dir, "lagging.db")
        with closing(sqlite3.connect(self.db)) as live, closing(sqlite3.connect(lagging)) as copy:
            live.backup(copy)  # what the bucket holds: the writes so far
        lost = []
        for body in ("lost-1", "lost-2"):
            code, reply = await self.http("POST", "/api/rooms/r/messages", {"body": body})
            self.assertEqual(code, 201)
            lost.append(reply["id"])
        code, scheduled = await self.http(
            "POST",
            "/api/rooms/r/messages",
            {"body": "later", "deliver_at": int(time.time()) + 3600},
        )
        self.assertEqual(code, 201)
        await self.kill(self.procs[-1])
        for suffix in ("", "-wal", "-shm"):
            if exists(self.db + suffix):
                os.remove(self.db + suffix)
        os.rename(lagging, self.db)  # the restore
        await self.start()
        code, fresh = await self.http("POST", "/api/rooms/r/messages", {"body": "after"})
        self.assertEqual(code, 201)
        self.assertGreater(fresh["id"], max(lost))
        code, again = await self.http(
            "POST",
            "/api/rooms/r/messages",
            {"body": "later", "deliver_at": int(time.time()) + 3600},
        )
        self.assertGreater(again["id"], scheduled["id"])
        # A client that saw the lost messages pages on from the last id it holds: it sees the new one.
        code, reply = await self.http("GET", f"/api/rooms/r/messages?after={max(lost)}")
        self.assertEqual([m["body"] for m in reply["messages"]], ["after"])

    async def test_bad_input(self) -> None:
        await self.start()
        exact = "é" * (32 * 1024)  # 64 KiB of UTF-8
        self.assertEqual(
            (await self.http("POST", "/api/rooms/r/messages", {"body": exact}))[0], 201
        )
        future = int(time.time()) + 60
        cases: list[tuple[str, str, bytes | None]] = [
            ("POST", "/api/rooms/bad.room/messages", b'{"body": "x"}'),
            ("POST", "/api/rooms/" + "a" * 65 + "/messages", b'{"body": "x"}'),
            ("GET", "/api/rooms/bad%20room/messages", None),
            ("POST", "/api/rooms/r/messages", json.dumps({"body": exact + "x"}).encode()),
            ("POST", "/api/rooms/r/messages", b'{"body": "x"'),
            ("POST", "/api/rooms/r/messages", b"\xff\xfe"),
            ("POST", "/api/rooms/r/messages", b'["body"]'),
            ("POST", "/api/rooms/r/messages", b'{"body": 7}'),
            ("POST", "/api/rooms/r/messages", b'{"body": ""}'),
            ("POST", "/api/rooms/r/messages", b'{"body": "\\ud800"}'),
            ("POST", "/api/rooms/r/messages", b'{"text": "x"}'),
            ("POST", "/api/rooms/r/messages", b'{"body": "x", "deliver_at": 5}'),
            ("POST", "/api/rooms/r/messages", b'{"body": "x", "deliver_at": "%d"}' % future),
            ("POST", "/api/rooms/r/messages", b'{"body": "x", "deliver_at": %d.5}' % future),
            ("GET", "/api/rooms/r/messages?after=-1", None),
            ("GET", "/api/rooms/r/messages?limit=0", None),
            ("GET", "/api/rooms/r/messages?limit=1001", None),
            ("GET", "/api/rooms/r/messages?after=x", None),
        ]
        for method, path, raw in cases:
            code, reply = await self.http(method, path, raw=raw)
            self.assertEqual(code, 400, (method, path, raw))
            self.assertIsInstance(reply["error"], str)
        for method, path, expected in [
            ("GET", "/", 404),
            ("GET", "/api", 404),
            ("GET", "/api/rooms/r", 404),
            ("GET", "/api/rooms/r/messages/1", 404),
            ("DELETE", "/api/rooms/r/messages", 405),
            ("GET", "/api/charter-next-due", 405),
            ("POST", "/api/rooms/r/ws", 405),
        ]:
            code, reply = await self.http(method, path, raw=b"" if method != "GET" else None)
            self.assertEqual(code, expected, (method, path))
        code, reply = await self.http("GET", "/api/rooms/r/messages")
        self.assertEqual([m["body"] for m in reply["messages"]], [exact], "nothing else stored")

    async def test_scheduled_message(self) -> None:
        await self.start()
        watcher = await self.ws("r1")
        deliver_at = int(time.time()) + 2
        code, reply = await self.http(
            "POST", "/api/rooms/r1/messages", {"body": "later", "deliver_at": deliver_at}
        )
        self.assertEqual(code, 201)
        self.assertEqual(
            reply, {"id": reply["id"], "room": "r1", "deliver_at": deliver_at, "scheduled": True}
        )
        self.assertEqual(await self.next_due(), deliver_at)
        charter = deliver_at + 300
        await self.http("POST", "/api/charter-next-due", {"due": charter}, token=BOT)
        self.assertEqual(await self.next_due(), deliver_at, "the earlier of the two")
        self.assertEqual((await self.http("GET", "/api/rooms/r1/messages"))[1], {"messages": []})

        pushed = await watcher.next(within=6)
        arrived = time.time()
        self.assertEqual((pushed["room"], pushed["body"]), ("r1", "later"))
        self.assertGreaterEqual(arrived, deliver_at)
        self.assertLess(arrived, deliver_at + 2.5)
        code, reply = await self.http("GET", "/api/rooms/r1/messages")
        self.assertEqual(reply["messages"], [pushed])
        self.assertEqual(await self.next_due(), charter, "delivered: only the charter is left")

    async def test_websocket_push(self) -> None:
        await self.start()
        a, b, other = await self.ws("r1"), await self.ws("r1"), await self.ws("r2")
        code, posted = await self.http("POST", "/api/rooms/r1/messages", {"body": "hello"})
        self.assertEqual(code, 201)
        self.assertEqual(await a.next(), posted)
        self.assertEqual(await b.next(), posted)

        b.send({"body": "from b"})
        from_b = await a.next()
        self.assertEqual((from_b["room"], from_b["body"]), ("r1", "from b"))
        self.assertEqual(await b.next(), from_b, "the sender gets its own message too")
        code, reply = await self.http("GET", "/api/rooms/r1/messages")
        self.assertEqual(reply["messages"], [posted, from_b])

        a.send("not json")
        self.assertIn("error", await a.next())
        a.send({"body": 5})
        self.assertIn("error", await a.next())

        code, elsewhere = await self.http("POST", "/api/rooms/r2/messages", {"body": "r2 only"})
        self.assertEqual(await other.next(), elsewhere, "r1 traffic never reached r2")

    async def test_setup_invite_claims_once(self) -> None:
        invite = "an-invite-of-the-operator"
        digest = hashlib.sha256(invite.encode()).hexdigest()
        await self.start(LCHAT_SETUP_INVITE_SHA256=digest.upper())  # hex in any case
        self.assertEqual(self.stats_row(), (0, 0, 0), "not set up before the claim")
        code, reply = await self.http("POST", "/api/setup", {"invite": "wrong"})
        self.assertEqual((code, reply), (403, {"error": "wrong setup invite"}))
        for bad in (b"{}", b'{"invite": 5}', b"[]", b"{"):
            self.assertEqual((await self.http("POST", "/api/setup", raw=bad))[0], 400, bad)
        self.assertEqual(self.stats_row()[0], 0, "a refused claim writes nothing")
        code, reply = await self.http("POST", "/api/setup", {"invite": invite})
        self.assertEqual((code, reply), (200, {"setup_complete": True}))
        self.assertEqual(self.stats_row(), (1, 0, 0), "set up, still no content")
        code, reply = await self.http("POST", "/api/setup", {"invite": invite})
        self.assertEqual(
            (code, reply), (403, {"error": "setup is already complete: the invite was used"})
        )
        self.assertEqual((await self.http("GET", "/api/setup"))[0], 405)

    async def test_no_setup_endpoint_without_an_invite(self) -> None:
        await self.start()
        for method in ("POST", "GET"):
            code, reply = await self.http(
                method, "/api/setup", {"invite": "x"} if method == "POST" else None
            )
            self.assertEqual((code, reply), (404, {"error": "not found"}))

    async def test_a_malformed_invite_hash_refuses_the_start(self) -> None:
        proc = self.spawn(LCHAT_SETUP_INVITE_SHA256="not-hex")
        await proc.ended
        self.assertNotEqual(proc.code, 0)
        self.assertIn(b"LCHAT_SETUP_INVITE_SHA256 must be 64 hex digits", proc.stderr)

    def stats_row(self) -> tuple[int, int, int]:
        """The lchat_stats view the router reads (read-only, as lchat.spacestats does)."""
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            row = conn.execute(
                "SELECT setup_complete, members, has_content FROM lchat_stats"
            ).fetchone()
        finally:
            conn.close()
        return tuple(int(v) for v in row)  # type: ignore[return-value]

    async def test_refuses_when_socket_is_live(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(listener.close)
        listener.bind(self.sock)
        listener.listen(5)
        proc = self.spawn()
        self.assertEqual(await proc.ended, 1)
        self.assertIn(b"already listening", proc.stderr)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
        self.assertTrue(exists(self.sock), "the other process keeps its socket")
        self.assertFalse(exists(self.db), "and its database is not touched")

    async def test_replaces_stale_socket(self) -> None:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(self.sock)
        stale.close()  # the file stays; nobody listens
        self.assertTrue(exists(self.sock))
        await self.start()
        self.assertEqual((await self.http("GET", "/api/version"))[0], 200)

    async def test_missing_env(self) -> None:
        for name in ("LCHAT_SOCKET", "LCHAT_DB"):
            proc = self.spawn(**{name: None})
            self.assertEqual(await proc.ended, 2, name)
            self.assertIn(name.encode(), proc.stderr)

    async def test_sigterm_drains(self) -> None:
        proc = await self.start()
        code, before = await self.http("POST", "/api/rooms/r1/messages", {"body": "before"})
        self.assertEqual(code, 201)
        now = int(time.time())
        await self.http(
            "POST", "/api/rooms/r1/messages", {"body": "someday", "deliver_at": now + 3600}
        )
        await self.http("POST", "/api/charter-next-due", {"due": now + 1800}, token=BOT)

        # A websocket client from another library, to see the close code.
        connected: Deferred[None] = Deferred()

        def watch() -> int | None:
            with unix_connect(self.sock, "ws://space.test/api/rooms/r1/ws", **WS_COMPAT) as ws:
                reactor.callFromThread(connected.callback, None)
                try:
                    while True:
                        ws.recv(timeout=30)
                except ConnectionClosed as e:
                    return e.rcvd.code if e.rcvd is not None else None

        closed_with = deferToThread(watch)
        await connected

        # A slow upload: headers now, half the body, then SIGTERM, then the rest.
        body = json.dumps({"body": "x" * 20000 + "slow"}).encode()
        raw = RawClient()
        await UNIXClientEndpoint(reactor, self.sock).connect(Factory.forProtocol(lambda: raw))
        assert raw.transport is not None
        raw.transport.write(
            b"POST /api/rooms/r1/messages HTTP/1.1\r\nHost: space.test\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        await self.poll(lambda: b"100 Continue" in raw.data, "100 Continue")
        raw.transport.write(body[:10000])
        proc.signal("TERM")
        await self.poll(lambda: not exists(self.sock), "the socket file to go")
        self.assertTrue(proc.running, "still draining the in-flight request")
        raw.transport.write(body[10000:])
        await raw.lost
        status = raw.data.split(b"\r\n\r\n", 1)[1].split(b"\r\n", 1)[0]
        self.assertEqual(status, b"HTTP/1.1 201 Created")
        slow = json.loads(raw.data.split(b"\r\n\r\n")[-1])

        self.assertEqual(await proc.ended, 0, proc.stderr)
        self.assertEqual(await closed_with, 1000)
        self.assertIn(b"space t.example stopped", proc.stderr)
        self.assertIn(f"space t.example listening on {self.sock}".encode(), proc.stderr)

        self.assertEqual(size(self.db + "-wal"), 0, "checkpointed on close")
        with closing(sqlite3.connect(self.db)) as db:
            rows = db.execute("SELECT id, body FROM messages ORDER BY id").fetchall()
        self.assertEqual(rows, [(before["id"], "before"), (slow["id"], slow["body"])])

        # The schedule and the charter report survive a restart.
        await self.start()
        self.assertEqual(await self.next_due(), now + 1800)

    async def test_sigterm_after_socket_file_removed(self) -> None:
        proc = await self.start()
        os.unlink(self.sock)  # e.g. an operator cleaning up the run directory
        proc.signal("TERM")
        self.assertEqual(await proc.ended, 0, proc.stderr)
        self.assertIn(b"space t.example stopped", proc.stderr)


class IdTests(SynchronousTestCase):
    """``store.next_id``: increasing in one database whatever the clock does, never below it."""

    def setUp(self) -> None:
        self.conn = sqlite3.connect(":memory:", isolation_level=None)
        self.addCleanup(self.conn.close)
        migrate(self.conn, store.MIGRATIONS, ValueError)

    def insert(self, floor: int) -> int:
        with write_transaction(self.conn):
            return store._insert_message(self.conn, "r", "b", 0, floor).id

    def test_the_clock_is_the_floor(self) -> None:
        self.assertEqual(self.insert(1_000_000), 1_000_000)
        self.assertEqual(self.insert(2_000_000), 2_000_000)

    def test_a_clock_that_steps_back_or_stands_still_never_repeats_an_id(self) -> None:
        first = self.insert(5_000_000)
        self.assertEqual([self.insert(5_000_000), self.insert(10)], [first + 1, first + 2])

    def test_a_deleted_last_row_is_not_reissued(self) -> None:
        last = self.insert(7)
        self.conn.execute("DELETE FROM messages WHERE id = ?", (last,))
        self.assertEqual(self.insert(0), last + 1)

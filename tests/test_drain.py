"""A graceful drain under forwarded write load.

End to end (real ``twistd lchat`` processes, one moto bucket): box A forwards POSTs over kept-alive
connections to box B, which owns the space; B gets SIGTERM. Every request B refuses unprocessed
because it is stopping is re-routed by A (which then wakes the space itself once B's drain
releases the lease): the clients see neither a 503 nor a 502, and every write they were told
succeeded is there afterwards.

In process: which refusals the activator marks, that only a request a peer forwarded gets the
marker, and how the forwarding box waits for a stopping peer's lease (a real file-store bucket).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import tempfile
import threading
import time
from typing import Any

from attrs import frozen
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat import config
from lchat.activator import Activator
from lchat.lease import acquire
from lchat.mesh import forward, routing
from lchat.mesh.routing import MeshRouter
from lchat.objstore import open_store
from lchat.proxy.http import REFUSED
from lchat.registry import Registry, Route, RouteSource
from lchat.router import LocalResponse, RemotePeer, RequestHead, Target
from tests.test_mesh import DOMAIN, Box, MeshTestCase, request

WRITERS = 4  # concurrent kept-alive client connections to the forwarding box


class _Writer(threading.Thread):
    """POSTs messages over one kept-alive HTTPS connection until told to stop; records every
    answer (status, headers, body) and every exception (a connection the router dropped)."""

    def __init__(self, box: Box, host: str, ca: str, name: str) -> None:
        super().__init__(daemon=True)
        self.box, self.host, self.ca, self.label = box, host, ca, name
        self.answers: list[tuple[int, dict[str, str], bytes, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None

    def _connect(self) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=self.ca)
        raw = socket.create_connection((self.box.address, self.box.port), timeout=30)
        conn = http.client.HTTPSConnection(self.host, self.box.port, timeout=30)
        conn.sock = context.wrap_socket(raw, server_hostname=self.host)
        return conn

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            text = f"{self.label}-{n}"
            try:
                if self._conn is None:
                    self._conn = self._connect()
                self._conn.request(
                    "POST",
                    "/api/rooms/r/messages",
                    body=json.dumps({"body": text}).encode(),
                    headers={"Host": self.host, "Content-Type": "application/json"},
                )
                resp = self._conn.getresponse()
                body = resp.read()
                headers = {k.lower(): v for k, v in resp.getheaders()}
                self.answers.append((resp.status, headers, body, time.monotonic()))
                if resp.will_close:
                    self._conn.close()
                    self._conn = None
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(f"{text}: {type(e).__name__}: {e}")
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
        if self._conn is not None:
            self._conn.close()

    def written(self) -> list[str]:
        return [json.loads(body)["body"] for status, _, body, _ in self.answers if status == 201]


def _join(threads: list[_Writer]) -> None:
    for t in threads:
        t.join(30)


class DrainTests(MeshTestCase):
    """The two-box mesh as the mesh end-to-end tests run it: 4 s lease TTL, 300 ms heartbeats."""

    timeout = 120

    @inlineCallbacks
    def test_forwarded_writes_across_a_drain_of_the_owner_all_succeed(self):
        host = f"drain.{DOMAIN}"
        boxes = self.boxes(2)
        for box in boxes:
            box.add_space(host)
        yield self.start(*boxes)
        first = b'{"body": "first"}'
        status, body, _ = yield deferToThread(
            request, boxes[0], host, "/api/rooms/r/messages", "POST", first, ca=self.ca
        )
        self.assertEqual(status, 201, body)
        owner = next(b for b in boxes if b.awake(host))
        forwarder = next(b for b in boxes if b is not owner)

        writers = [_Writer(forwarder, host, self.ca, f"w{i}") for i in range(WRITERS)]
        for w in writers:
            w.start()
        try:
            # Load flows through the forwarder to the owner before the drain begins...
            yield self.wait_for(lambda: sum(len(w.answers) for w in writers) >= 40, timeout=30)
            code = yield deferToThread(owner.stop, signal.SIGTERM)
            self.assertIn(code, (0, -signal.SIGTERM), owner.log()[-3000:])
            stopped = time.monotonic()
            # ...and goes on until the survivor has served a good many writes itself.
            yield self.wait_for(
                lambda: sum(1 for w in writers for a in w.answers if a[3] > stopped) >= 40,
                timeout=30,
            )
        finally:
            for w in writers:
                w.stop.set()
            yield deferToThread(_join, writers)

        answers = [a for w in writers for a in w.answers]
        statuses: dict[int, int] = {}
        for status, _, _, _ in answers:
            statuses[status] = statuses.get(status, 0) + 1
        refused = [(s, b[:200]) for s, _, b, _ in answers if s != 201][:5]
        logs = "\n".join(b.log()[-4000:] for b in boxes)
        self.assertEqual(statuses, {201: len(answers)}, f"{refused}\n{logs}")
        self.assertEqual([e for w in writers for e in w.errors], [], logs)
        leaked = [h for _, headers, _, _ in answers for h in headers if h.startswith("x-lchat-r")]
        self.assertEqual(leaked, [])
        self.assertTrue(forwarder.awake(host))

        # Every acknowledged write is there, served by the survivor.
        status, body, _ = yield deferToThread(
            request, forwarder, host, "/api/rooms/r/messages?limit=1000", ca=self.ca
        )
        self.assertEqual(status, 200, body)
        stored = [m["body"] for m in json.loads(body)["messages"]]
        acknowledged = ["first", *(text for w in writers for text in w.written())]
        self.assertLess(len(acknowledged), 1000)  # one page holds them all
        self.assertEqual(sorted(set(acknowledged) - set(stored)), [])


SELF = "http://a.example.net"
PEER = "http://b.example.net"
MESH_TOKEN = "drain-token-" + "y" * 20


@frozen
class _Member:
    url: str
    region: str = ""
    age: float = 1.0  # seconds since its last beat at the read (the defaults: 15 s beats, 45 s)


class _Membership:
    """The membership's view, changed by the test as a read would change it."""

    def __init__(self, *urls: str) -> None:
        self.members = [_Member(u) for u in urls]
        self._subscribers: list[Any] = []

    def live(self) -> list[_Member]:
        return list(self.members)

    def subscribe(self, fn: Any) -> None:
        self._subscribers.append(fn)

    def read(self, *members: _Member) -> None:
        old, self.members = self.members, list(members)
        for fn in self._subscribers:
            fn(old, list(members))


class _NothingHere:
    """The activator as the mesh sees it, running nothing."""

    def holds(self, host: str) -> bool:
        return False


def _wait(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class DrainRoutingTests(TestCase):
    """The owner side marks only its drain's refusals, only for a peer; the forwarding side
    waits for a stopping peer's lease instead of meeting it held."""

    timeout = 20

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="drain", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        data = os.path.join(self.dir, "data")
        os.makedirs(data)
        os.makedirs(os.path.join(self.dir, "bucket"))  # the router would have made it
        env_file = os.path.join(self.dir, "router.env")
        settings = {
            "LCHAT_DATA_DIR": data,
            "LCHAT_RUN_DIR": os.path.join(self.dir, "run"),
            "LCHAT_UNITS": "builtin",
            "LCHAT_HIBERNATE_BUCKET": f"file:{os.path.join(self.dir, 'bucket')}",
            "LCHAT_MESH_SELF": SELF,
            "LCHAT_MESH_DOMAINS": "mesh.example",
            "LCHAT_MESH_TOKEN": MESH_TOKEN,
            "LCHAT_HTTP_REDIRECT": "off",
        }
        with open(env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in settings.items())
        self.cfg = config.load(env_file=env_file, environ={})
        assert self.cfg.hibernate is not None
        self.store = open_store(reactor, self.cfg.hibernate.bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(self.store.close()))
        self.host = "s.mesh.example"
        self.route = Route(
            host=self.host, kind="instance", socket="/nonexistent", status="ready", hibernate=True
        )
        self.served_here = LocalResponse(200, b"served here\n")

    def mesh(self, *members: str) -> MeshRouter:
        return self.mesh_of(_Membership(*members))

    def mesh_of(self, membership: _Membership) -> MeshRouter:
        return MeshRouter(self.cfg, self.store, membership, _NothingHere())

    def head(self, forwarded: bytes | None = None) -> RequestHead:
        return RequestHead(method=b"POST", target=b"/", host=self.host, forwarded=forwarded)

    async def hold_lease(self, owner: str) -> str:
        assert self.cfg.hibernate is not None
        key = self.cfg.hibernate.key(self.host, "lock.json")
        await acquire(self.store, key, owner, 30.0, host=self.host)
        return key

    @inlineCallbacks
    def _routed(self, mesh: MeshRouter, head: RequestHead, local: Any) -> Any:
        target = mesh.route(self.route, head, local)
        if isinstance(target, Deferred):
            target = yield target
        return target

    @inlineCallbacks
    def test_only_a_refusal_to_an_authentic_forwarded_request_is_marked(self):
        refusal = LocalResponse(503, b"stopping\n", ((b"retry-after", b"5"),), refusal="stopping")
        mesh = self.mesh(SELF)
        authentic = self.head(forward.marker(MESH_TOKEN, self.host))
        forged = self.head(forward.marker("not-the-token", self.host))
        got = yield self._routed(mesh, authentic, lambda: refusal)
        self.assertIn((REFUSED, b"stopping"), got.headers)
        got = yield self._routed(mesh, authentic, lambda: succeed(refusal))  # after a wait
        self.assertIn((REFUSED, b"stopping"), got.headers)
        for head in (self.head(), forged):  # a client's request: the plain 503
            got = yield self._routed(mesh, head, lambda: refusal)
            self.assertEqual(got.headers, refusal.headers)
        plain = LocalResponse(503, b"busy\n", ((b"retry-after", b"5"),))  # not the drain's
        got = yield self._routed(mesh, authentic, lambda: plain)
        self.assertEqual(got, plain)

    @inlineCallbacks
    def test_only_a_stopping_activator_marks_and_only_its_drain_refusals(self):
        registry = Registry(self.cfg.registry)
        registry.migrate()
        routes = RouteSource(reactor, registry, registry.load())
        activator = Activator(reactor, self.cfg, routes, self.store)
        activator.startService()
        sidecar = activator.route(self.route, sidecar=True)
        assert isinstance(sidecar, LocalResponse)
        self.assertEqual((sidecar.status, sidecar.refusal), (503, ""))
        yield activator.stopService()
        stopping = activator.route(self.route)
        assert isinstance(stopping, LocalResponse)
        self.assertEqual((stopping.status, stopping.refusal), (503, "stopping"))
        self.assertIn(b"the router is stopping", stopping.body)
        sidecar = activator.route(self.route, sidecar=True)  # refused for its own reason
        assert isinstance(sidecar, LocalResponse)
        self.assertEqual(sidecar.refusal, "")

    async def _to_peer(self, mesh: MeshRouter) -> RemotePeer:
        """The forward the mesh makes while the peer holds the lease."""
        target = await Deferred.fromCoroutine(
            _resolved(mesh.route(self.route, self.head(), lambda: self.served_here))
        )
        assert isinstance(target, RemotePeer) and target.fallback is not None, target
        self.assertEqual(target.address, "b.example.net")
        return target

    @inlineCallbacks
    def test_a_refused_request_waits_for_the_stopping_peer_to_release_the_lease(self):
        key = yield Deferred.fromCoroutine(self.hold_lease(PEER))
        mesh = self.mesh(SELF, PEER)
        target = yield Deferred.fromCoroutine(self._to_peer(mesh))
        assert target.fallback is not None
        rerouted = target.fallback("stopping")
        assert isinstance(rerouted, Deferred)
        # A request arriving meanwhile (not a re-routed one) waits the same way.
        fresh = mesh.route(self.route, self.head(), lambda: self.served_here)
        assert isinstance(fresh, Deferred)
        yield _wait(0.5)
        # A wake here now would only meet the held lease.
        self.assertEqual((rerouted.called, fresh.called), (False, False))
        yield Deferred.fromCoroutine(self.store.delete(key))  # the drain's release
        started = time.monotonic()
        got = yield rerouted
        self.assertIs(got, self.served_here)
        got = yield fresh
        self.assertIs(got, self.served_here)
        self.assertLess(time.monotonic() - started, 2.0)  # lock.json is read every 0.1 s

    @inlineCallbacks
    def test_a_peer_whose_heartbeat_was_deleted_is_awaited_one_that_aged_out_is_not(self):
        """No request reached the draining peer to be refused, but the view lost it while its
        heartbeat was fresh: only a drain deletes it, so its lease is about to be released."""
        key = yield Deferred.fromCoroutine(self.hold_lease(PEER))
        membership = _Membership(SELF, PEER)
        mesh = self.mesh_of(membership)
        membership.read(_Member(SELF))  # PEER was 1 s old at the last read: deleted
        waiting = mesh.route(self.route, self.head(), lambda: self.served_here)
        assert isinstance(waiting, Deferred)
        yield _wait(0.5)
        self.assertFalse(waiting.called)
        yield Deferred.fromCoroutine(self.store.delete(key))
        got = yield waiting
        self.assertIs(got, self.served_here)

        # Aged out (40 s old at the last read, gone 45 s after its beat): dead or cut off, and
        # its lease lasts until it expires. The wake here answers lease_held at once.
        yield Deferred.fromCoroutine(self.hold_lease(PEER))
        membership = _Membership(SELF, PEER)
        membership.members[1] = _Member(PEER, age=40.0)
        mesh = self.mesh_of(membership)
        membership.read(_Member(SELF))
        started = time.monotonic()
        got = yield _resolved_d(mesh.route(self.route, self.head(), lambda: self.served_here))
        self.assertIs(got, self.served_here)
        self.assertLess(time.monotonic() - started, 1.0)

        # Back in the view (restarted): not draining any more, forwarded to at once.
        membership = _Membership(SELF, PEER)
        mesh = self.mesh_of(membership)
        membership.read(_Member(SELF))
        membership.read(_Member(SELF), _Member(PEER))
        got = yield _resolved_d(mesh.route(self.route, self.head(), lambda: self.served_here))
        self.assertIsInstance(got, RemotePeer)

    @inlineCallbacks
    def test_an_unreachable_peer_is_not_waited_for(self):
        """A peer that cannot be reached may be dead: its lease lasts until it expires, and the
        wake here answers lease_held at once (no 10 s wait per request)."""
        yield Deferred.fromCoroutine(self.hold_lease(PEER))
        mesh = self.mesh(SELF, PEER)
        target = yield Deferred.fromCoroutine(self._to_peer(mesh))
        assert target.fallback is not None
        started = time.monotonic()
        got = yield _resolved_d(target.fallback("unreachable"))
        self.assertIs(got, self.served_here)
        self.assertLess(time.monotonic() - started, 1.0)

    @inlineCallbacks
    def test_the_wait_for_a_release_is_bounded(self):
        self.patch(routing, "RELEASE_WAIT", 0.5)
        yield Deferred.fromCoroutine(self.hold_lease(PEER))
        mesh = self.mesh(SELF, PEER)
        target = yield Deferred.fromCoroutine(self._to_peer(mesh))
        assert target.fallback is not None
        started = time.monotonic()
        got = yield _resolved_d(target.fallback("stopping"))
        self.assertIs(got, self.served_here)  # the activator answers lease_held from here
        self.assertGreaterEqual(time.monotonic() - started, 0.4)


async def _resolved(target: Target | Deferred[Target]) -> Target:
    if isinstance(target, Deferred):
        return await target
    return target


def _resolved_d(target: Target | Deferred[Target]) -> Deferred[Target]:
    return Deferred.fromCoroutine(_resolved(target))

"""A graceful drain under forwarded write load.

End to end (real ``twistd lchat`` processes, one moto bucket): box A forwards POSTs over kept-alive
connections to box B, which owns the space; B gets SIGTERM. Every request B refuses unprocessed
because it is stopping is re-routed by A (which then wakes the space itself once B's drain
releases the lease): the clients see neither a 503 nor a 502, and every write they were told
succeeded is there afterwards.

In process: which refusals the activator marks (the mesh side, on a fake clock, is in
tests/test_mesh_routing.py).
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

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat import config
from lchat.hibernation.activator import Activator
from lchat.hibernation.lifecycle import Lifecycle
from lchat.hibernation.sidecars import Sidecars
from lchat.objstore import open_store
from lchat.reactors import installed
from lchat.registry import Registry, Route
from lchat.router import LocalResponse
from lchat.routesource import RouteSource
from lchat.supervise import Supervisor
from lchat.threads import thread_runner
from lchat.units import Claims
from tests.test_mesh import DOMAIN, Box, MeshTestCase, request

reactor = installed()

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


class DrainRoutingTests(TestCase):
    """The owner side marks only its drain's refusals (the forwarding side's routing, and the
    marker only for an authentic forwarded request: tests/test_mesh_routing.py)."""

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
        self.store = open_store(
            reactor, self.cfg.hibernate.where, thread_runner(reactor), monotonic=time.monotonic
        )
        self.addCleanup(lambda: Deferred.fromCoroutine(self.store.close()))
        self.host = "s.mesh.example"
        self.route = Route(
            host=self.host, kind="instance", socket="/nonexistent", status="ready", hibernate=True
        )
        self.served_here = LocalResponse(200, b"served here\n")

    @inlineCallbacks
    def test_only_a_stopping_activator_marks_and_only_its_drain_refusals(self):
        registry = Registry(self.cfg.registry, clock=time.time)
        registry.migrate()
        routes = RouteSource(
            reactor, registry, registry.load(), run_in_thread=thread_runner(reactor)
        )
        run = thread_runner(reactor)
        sidecars = Sidecars(reactor, self.cfg, run, Supervisor(reactor))
        lifecycle = Lifecycle(
            reactor, self.cfg, self.store, routes, run, sidecars, monotonic=time.monotonic
        )
        activator = Activator(reactor, routes, lifecycle, Claims())
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

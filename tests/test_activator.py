"""Hibernation end to end: the router as twistd builds it (in this process, on the real reactor),
real reference-space processes, a real bucket (a ``file:`` bucket; moto where the S3 path matters).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from lchat import config
from lchat.child import listener_pid
from lchat.config import BoxConfig
from lchat.hibernation import lifecycle as lifecycle_module
from lchat.hibernation.localdb import MARKER_SUFFIX
from lchat.hibernation.space import Budgets
from lchat.objstore import open_store
from lchat.objstore.where import Where
from lchat.reactors import installed
from lchat.registry import Registry, Route
from lchat.replica.restore import restore
from lchat.routesource import RouteSource
from lchat.tap import build_service, listening_ports
from lchat.threads import thread_runner
from tests import s3servers
from tests.routerproc import kill_spaces_under, spawn_router

reactor = installed()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space"
SIDECAR = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space.sidecar"
TOKEN = "a" * 32
BOT_TOKEN = "b" * 32


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class _Harness(TestCase):
    """A hibernating router per test (no tests of its own)."""

    timeout = 120

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="hib", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.data = os.path.join(self.dir, "d")
        self.rundir = os.path.join(self.dir, "r")
        self.bucket = os.path.join(self.dir, "bucket")
        os.mkdir(self.data)
        os.mkdir(self.bucket)
        self.env = os.path.join(self.dir, "router.env")
        with open(self.env, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR={self.rundir}\nLCHAT_UNITS=builtin\n"
            )
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    def config(self, **extra: str) -> BoxConfig:
        flags = {
            "LCHAT_HTTP_ADDR": "tcp:0:interface=127.0.0.1",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_SPACE_COMMAND": SPACE,
            "LCHAT_SIDECAR_COMMAND": SIDECAR,
            "LCHAT_HIBERNATE_BUCKET": f"file:{self.bucket}",
            "LCHAT_HIBERNATE_IDLE": "1s",
            "LCHAT_HIBERNATE_SWEEP": "200ms",
            "LCHAT_DUE_SWEEP": "300ms",
            "LCHAT_LEASE_TTL": "30s",
        }
        flags.update(extra)
        environ = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", "")}
        return config.load(env_file=self.env, environ=environ, flags=flags)

    def s3_config(self, server: Any, bucket: str, ttl: str = "60s") -> BoxConfig:
        """A hibernating router's settings on ``bucket`` of the S3 ``server`` (tests/s3servers).
        Its credentials are in its env file, as on a box (``AWS_*`` in router.env), never in
        this process's environment."""
        with open(self.env) as f:
            base = f.read()
        env_file = self.env + ".s3"
        with open(env_file, "w") as f:
            f.write(base)
            f.write(f"AWS_ACCESS_KEY_ID={server.credentials.access_key}\n")
            f.write(f"AWS_SECRET_ACCESS_KEY={server.credentials.secret_key}\n")
        environ = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", "")}
        flags = {
            "LCHAT_HTTP_ADDR": "tcp:0:interface=127.0.0.1",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_SPACE_COMMAND": SPACE,
            "LCHAT_HIBERNATE_BUCKET": bucket,
            "LCHAT_HIBERNATE_ENDPOINT": server.endpoint,
            "LCHAT_HIBERNATE_REGION": server.region,
            "LCHAT_HIBERNATE_IDLE": "60s",
            "LCHAT_LEASE_TTL": ttl,
        }
        return config.load(env_file=env_file, environ=environ, flags=flags)

    def add_space(self, host: str, **row: Any) -> Route:
        registry = Registry(self.config().registry, clock=time.time)
        registry.migrate()
        env_file = os.path.join(self.data, f"{host}.env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"LCHAT_ADMIN_TOKEN={TOKEN}\nLCHAT_BOT_TOKEN={BOT_TOKEN}\n".encode())
        os.close(fd)
        fields: dict[str, Any] = {"hibernate": True, "status": "ready"}
        fields.update(row)
        return registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=os.path.join(self.rundir, f"{host}.sock"),
                **fields,
            )
        )

    def update_row(self, host: str, **changes: Any) -> None:
        Registry(self.cfg.registry, clock=time.time).update(host, **changes)

    def start(self, cfg: BoxConfig | None = None) -> Any:
        cfg = cfg or self.config()
        service = build_service(cfg, reactor, poll_interval=0.2)
        service.startService()
        self.addCleanup(service.stopService)
        ports: list[Any] = listening_ports(service)
        self.port = next(p.getHost().port for p in ports if hasattr(p.getHost(), "port"))
        self.cfg = cfg
        self.service = service
        self.routes = next(s for s in service if isinstance(s, RouteSource))
        self.activator = service.getServiceNamed("hibernation").activator
        return service

    @inlineCallbacks
    def request(
        self,
        host: str,
        path: str = "/api/version",
        method: bytes = b"GET",
        body: bytes | None = None,
        headers: dict[bytes, bytes] | None = None,
    ) -> Any:
        import io

        from twisted.web.client import FileBodyProducer

        hdrs = Headers({b"host": [host.encode()]})
        for k, v in (headers or {}).items():
            hdrs.addRawHeader(k, v)
        producer = FileBodyProducer(io.BytesIO(body)) if body is not None else None
        if body is not None:
            hdrs.addRawHeader(b"content-type", b"application/json")
        response = yield Agent(reactor, pool=self.pool).request(
            method, f"http://127.0.0.1:{self.port}{path}".encode(), hdrs, producer
        )
        data = yield readBody(response)
        return response, data

    @inlineCallbacks
    def wait_for(self, predicate: Any, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            yield sleep(0.05)
        self.fail(f"timed out waiting for {predicate}")

    def next_due(self, host: str) -> int:
        row = self.routes.table.get(host)
        assert row is not None
        return row.next_due

    def state(self, host: str) -> str:
        return self.activator.state(host)

    def lock_exists(self, host: str) -> bool:
        return os.path.exists(os.path.join(self.bucket, "objects")) and any(
            "lock.json" in name for name in _bucket_keys(self.bucket, host)
        )


class HibernationTests(_Harness):
    # -- waking --------------------------------------------------------------------------------

    @inlineCallbacks
    def test_concurrent_first_requests_share_one_wake(self):
        self.add_space("a.example")
        spawned: list[Any] = []
        real_spawn = lifecycle_module.spawn

        def counting_spawn(*args: Any, **kwargs: Any) -> Any:
            child = real_spawn(*args, **kwargs)
            spawned.append(child)
            return child

        self.patch(lifecycle_module, "spawn", counting_spawn)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))  # no idle sleep on a slow machine
        self.assertEqual(self.state("a.example"), "asleep")
        results = yield DeferredList(
            [self.request("a.example") for _ in range(200)], consumeErrors=True
        )
        statuses = []
        for ok, value in results:
            self.assertTrue(ok, value)  # no reset, no connection error
            response, body = value
            statuses.append(response.code)
            if response.code == 503:
                self.assertTrue(response.headers.hasHeader(b"retry-after"))
            else:
                self.assertEqual(response.code, 200, body)
                self.assertEqual(json.loads(body)["version"], "0.1.0")
        self.assertEqual(len(spawned), 1)
        self.assertIn(200, statuses)
        self.assertNotIn(502, statuses)
        self.assertEqual(self.state("a.example"), "awake")
        # The requests that waited say so; once awake, nobody waits.
        response, _ = yield self.request("a.example")
        self.assertFalse(response.headers.hasHeader(b"x-lchat-wake"))
        self.assertTrue(self.lock_exists("a.example"))

    @inlineCallbacks
    def test_waiting_request_carries_x_lchat_wake(self):
        self.add_space("w.example")
        self.start()
        response, _ = yield self.request("w.example")
        self.assertEqual(response.code, 200)
        (value,) = response.headers.getRawHeaders(b"x-lchat-wake")
        self.assertTrue(value.endswith(b"s"))
        self.assertGreater(float(value[:-1]), 0.0)

    # -- sleeping ------------------------------------------------------------------------------

    @inlineCallbacks
    def test_never_sleeps_with_a_websocket_open(self):
        self.add_space("ws.example")
        self.start()
        yield self.request("ws.example")
        ws = yield deferToThread(_open_websocket, self.port, "ws.example", "/api/rooms/r/ws")
        try:
            yield sleep(2.5)  # well past the 1 s idle window
            self.assertEqual(self.state("ws.example"), "awake")
        finally:
            ws.close()
        yield self.wait_for(lambda: self.state("ws.example") == "asleep", timeout=10)

    @inlineCallbacks
    def test_sidecar_traffic_never_wakes_and_earns_no_idle_credit(self):
        self.add_space("bot.example")
        self.start()
        sidecar = {b"x-lchat-sidecar": b"1"}
        response, _body = yield self.request("bot.example", headers=sidecar)
        self.assertEqual(response.code, 503)
        self.assertTrue(response.headers.hasHeader(b"retry-after"))
        self.assertEqual(self.state("bot.example"), "asleep")
        yield self.request("bot.example")  # a member wakes it
        self.assertEqual(self.state("bot.example"), "awake")
        # A sidecar polling every 100 ms does not keep it awake.
        deadline = time.monotonic() + 6
        while self.state("bot.example") == "awake" and time.monotonic() < deadline:
            response, _ = yield self.request("bot.example", headers=sidecar)
            self.assertIn(response.code, (200, 503))
            yield sleep(0.1)
        yield self.wait_for(lambda: self.state("bot.example") == "asleep", timeout=10)

    @inlineCallbacks
    def test_staged_sidecar_runs_only_while_awake_and_reports_next_due(self):
        self.add_space("side.example")
        bot_env = os.path.join(self.data, "side.example-bot.env")
        fd = os.open(bot_env, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"LCHAT_BOT_TOKEN={BOT_TOKEN}\nLCHAT_BOT_EVERY=3600\n".encode())
        os.close(fd)
        self.start(self.config(LCHAT_HIBERNATE_IDLE="3s"))
        yield self.request("side.example")
        status = yield self.wait_for(
            lambda: self.activator.status()["side.example"].get("sidecar", {}).get("pid")
        )
        pid = int(status)
        self.assertTrue(_alive(pid))
        yield self.wait_for(lambda: self.state("side.example") == "asleep", timeout=15)
        yield self.wait_for(lambda: not _alive(pid), timeout=5)
        # The charter's next run (about an hour away) became the row's next_due.
        row = yield self.wait_for(lambda: self.next_due("side.example") or None)
        self.assertLess(abs(row - (time.time() + 3600)), 120)

    @inlineCallbacks
    def test_scheduled_message_is_delivered_by_a_due_wake(self):
        self.add_space("sched.example")
        self.start()
        due = int(time.time()) + 3
        response, body = yield self.request(
            "sched.example",
            "/api/rooms/r/messages",
            b"POST",
            json.dumps({"body": "later", "deliver_at": due}).encode(),
        )
        self.assertEqual(response.code, 201, body)
        yield self.activator.sleep("sched.example", "test")
        self.assertEqual(self.next_due("sched.example"), due)
        # Asleep through the due time; the due sweep wakes it and the space delivers.
        yield self.wait_for(lambda: self.state("sched.example") == "awake", timeout=15)
        self.assertGreaterEqual(time.time(), due)
        yield sleep(1.5)
        response, body = yield self.request("sched.example", "/api/rooms/r/messages")
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["later"])

    # -- failure is the wake path --------------------------------------------------------------

    @inlineCallbacks
    def test_hibernate_off_hands_the_space_back(self):
        self.add_space("off.example")
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request("off.example", "/api/rooms/r/messages", b"POST", b'{"body": "on"}')
        self.assertEqual(self.state("off.example"), "awake")
        self.update_row("off.example", hibernate=False)
        yield self.routes.reload("test")
        yield self.wait_for(lambda: self.state("off.example") == "asleep", timeout=15)
        self.assertFalse(self.lock_exists("off.example"))  # flushed and released
        # Only then do the builtin units run it as an always-on space, with its data.
        asleep_at = reactor.seconds()
        units = next(s for s in self.service.getServiceNamed("spaces") if hasattr(s, "supervisor"))
        child = yield self.wait_for(lambda: units.supervisor.child("off.example"))
        self.assertGreaterEqual(child.started_at, asleep_at - 0.1)  # never two at once
        response, body = yield self.request("off.example", "/api/rooms/r/messages")
        self.assertEqual(response.code, 200, body)
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["on"])

    @inlineCallbacks
    def test_cold_wake_restores_from_the_bucket(self):
        self.add_space("cold.example")
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request("cold.example", "/api/rooms/r/messages", b"POST", b'{"body": "one"}')
        yield self.activator.sleep("cold.example", "test")
        for suffix in ("", "-wal", "-shm", MARKER_SUFFIX):
            path = os.path.join(self.data, "cold.example.db" + suffix)
            if os.path.exists(path):
                os.unlink(path)
        _response, body = yield self.request("cold.example", "/api/rooms/r/messages")
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["one"])

    @inlineCallbacks
    def test_warm_wake_resumes_the_replica_without_a_snapshot(self):
        self.add_space("warm.example")
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        yield self.request("warm.example", "/api/rooms/r/messages", b"POST", b'{"body": "1"}')
        yield self.activator.sleep("warm.example", "test")
        snapshots = [k for k in _bucket_keys(self.bucket, "warm.example") if "/0009@d/" in k]
        self.assertEqual(len(snapshots), 1)
        for body in (b'{"body": "2"}', b'{"body": "3"}'):
            yield self.request("warm.example", "/api/rooms/r/messages", b"POST", body)
            yield self.activator.sleep("warm.example", "test")
        # Two more wakes, no more snapshots: each continued the replica after its marker.
        self.assertEqual(
            [k for k in _bucket_keys(self.bucket, "warm.example") if "/0009@d/" in k], snapshots
        )
        store = open_store(
            reactor, Where(f"file:{self.bucket}"), thread_runner(reactor), monotonic=time.monotonic
        )
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        out = os.path.join(self.dir, "warm.restored")
        yield Deferred.fromCoroutine(
            restore(store, "warm.example", out, run_in_thread=thread_runner(reactor))
        )
        self.assertEqual([m[1] for m in _messages(out)], ["1", "2", "3"])

    @inlineCallbacks
    def test_drain_flushes_and_releases_every_awake_space(self):
        hosts = [f"d{i}.example" for i in range(4)]
        for host in hosts:
            self.add_space(host)
        service = self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        results = yield DeferredList(
            [
                self.request(h, "/api/rooms/r/messages", b"POST", json.dumps({"body": h}).encode())
                for h in hosts
            ],
            consumeErrors=True,
        )
        self.assertTrue(all(ok and value[0].code == 201 for ok, value in results), results)
        started = time.monotonic()
        yield service.stopService()
        self.assertLess(time.monotonic() - started, 30)
        for host in hosts:
            self.assertFalse(self.lock_exists(host), host)
        # A second router with none of the local files (another box): every space cold-wakes
        # from what the first one parked.
        for name in os.listdir(self.data):
            if ".example.db" in name:
                os.unlink(os.path.join(self.data, name))
        self.start(self.config(LCHAT_HIBERNATE_IDLE="60s"))
        results = yield DeferredList(
            [self.request(h, "/api/rooms/r/messages") for h in hosts], consumeErrors=True
        )
        for host, (ok, value) in zip(hosts, results, strict=True):
            self.assertTrue(ok, value)
            response, body = value
            self.assertEqual(response.code, 200, body)
            self.assertEqual([m["body"] for m in json.loads(body)["messages"]], [host])

    @inlineCallbacks
    def test_a_drain_lets_requests_in_flight_finish_before_stopping_the_space(self):
        """SIGTERM to a space races the requests already written to it (a space closes the
        kept-alive connections it has not read a request on yet, and this one does not even
        drain): a graceful sleep waits for them first, so each gets its answer."""
        self.add_space("inflight.example")
        slow = f"{sys.executable} {os.path.join(ROOT, 'tests', 'slow_space.py')}"
        service = self.start(self.config(LCHAT_SPACE_COMMAND=slow, LCHAT_HIBERNATE_IDLE="60s"))
        response, body = yield self.request("inflight.example")
        self.assertEqual(response.code, 200, body)
        pending = [self.request("inflight.example", "/slow") for _ in range(3)]
        yield self.wait_for(lambda: self.activator.status()["inflight.example"]["inflight"] == 3)
        stopped = service.stopService()
        results = yield DeferredList(pending, consumeErrors=True)
        for ok, value in results:
            self.assertTrue(ok, value)
            response, body = value
            self.assertEqual((response.code, body), (200, b'{"slow": true}'))
        yield stopped
        self.assertFalse(self.lock_exists("inflight.example"))

    @inlineCallbacks
    def test_a_space_left_running_by_a_dead_router_is_stopped_first(self):
        self.add_space("orphan.example")
        sock = os.path.join(self.rundir, "orphan.example.sock")
        os.makedirs(self.rundir, exist_ok=True)
        env = dict(
            os.environ,
            PYTHONPATH=ROOT,
            LCHAT_SOCKET=sock,
            LCHAT_DB=os.path.join(self.data, "orphan.example.db"),
            LCHAT_HOST="orphan.example",
        )
        orphan = subprocess.Popen(
            [sys.executable, "-m", "lchat.space"], env=env, start_new_session=True
        )

        def reap() -> None:
            if orphan.poll() is None:
                orphan.kill()
                orphan.wait()

        self.addCleanup(reap)
        yield self.wait_for(lambda: listener_pid(sock) == orphan.pid)
        self.start()
        response, body = yield self.request("orphan.example")
        self.assertEqual(response.code, 200, body)
        self.assertIsNotNone(orphan.poll())  # stopped (and reaped by Popen)
        self.assertNotEqual(self.activator.status()["orphan.example"]["pid"], orphan.pid)


class HibernationS3Tests(_Harness):
    """The S3 paths: a bucket that stops answering while spaces are awake."""

    @inlineCallbacks
    def _s3_router(self, *hosts: str, ttl: str = "60s") -> Any:
        server = yield Deferred.fromCoroutine(s3servers.start_server("moto"))
        self.addCleanup(lambda: Deferred.fromCoroutine(server.destroy()))
        bucket = yield Deferred.fromCoroutine(server.new_bucket())
        for host in hosts:
            self.add_space(host)
        cfg = self.s3_config(server, bucket, ttl)
        self.start(cfg)
        return server, bucket

    @inlineCallbacks
    def test_cold_wake_with_the_bucket_down_is_a_503_then_works(self):
        server, _ = yield self._s3_router("cold-s3.example")
        self.activator.budgets = Budgets(queue=3.0)
        server.pause()
        try:
            response, body = yield self.request("cold-s3.example")
            self.assertEqual(response.code, 503, body)
            self.assertTrue(response.headers.hasHeader(b"retry-after"))
        finally:
            server.resume()
        # The wake went on (only the request stopped waiting): it completes once the bucket
        # answers, and the next request is served.
        yield self.wait_for(lambda: self.state("cold-s3.example") != "waking", timeout=60)
        response, body = yield self.request("cold-s3.example")
        self.assertEqual(response.code, 200, body)

    @inlineCallbacks
    def test_lease_lost_to_an_outage_keeps_the_newer_local_copy(self):
        """Renewals failed (the bucket hung) but nobody took the lease: the local database
        holds writes the bucket never got, so it is kept, and the next wake snapshots it."""
        server, bucket = yield self._s3_router("outage.example", ttl="3s")
        yield self.request("outage.example", "/api/rooms/r/messages", b"POST", b'{"body": "a"}')
        server.pause()
        try:
            response, _ = yield self.request(
                "outage.example", "/api/rooms/r/messages", b"POST", b'{"body": "during"}'
            )
            self.assertEqual(response.code, 201)  # still serving while the bucket hangs
            yield self.wait_for(lambda: self.state("outage.example") == "asleep", timeout=20)
        finally:
            server.resume()
        self.assertTrue(os.path.exists(os.path.join(self.data, "outage.example.db")))
        self.assertFalse(any(".lease-lost-" in n for n in os.listdir(self.data)))
        yield sleep(3.5)  # the lease expires on the bucket's clock (or is reclaimed as ours)
        response, body = yield self.request("outage.example", "/api/rooms/r/messages")
        self.assertEqual(response.code, 200, body)
        self.assertEqual([m["body"] for m in json.loads(body)["messages"]], ["a", "during"])
        yield self.activator.sleep("outage.example", "test")
        store = s3servers.store_for(server, bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        out = os.path.join(self.dir, "outage.restored")
        yield Deferred.fromCoroutine(
            restore(store, "outage.example", out, run_in_thread=thread_runner(reactor))
        )
        self.assertEqual([m[1] for m in _messages(out)], ["a", "during"])

    @inlineCallbacks
    def test_bucket_hung_while_awake_keeps_serving_and_catches_up(self):
        server, bucket = yield self._s3_router("s3.example")
        response, _ = yield self.request(
            "s3.example", "/api/rooms/r/messages", b"POST", b'{"body": "before"}'
        )
        self.assertEqual(response.code, 201)
        server.pause()
        try:
            for i in range(3):
                response, _ = yield self.request(
                    "s3.example",
                    "/api/rooms/r/messages",
                    b"POST",
                    json.dumps({"body": f"during {i}"}).encode(),
                )
                self.assertEqual(response.code, 201)
            yield sleep(1.5)
            self.assertEqual(self.state("s3.example"), "awake")
        finally:
            server.resume()
        yield self.activator.sleep("s3.example", "test")
        store = s3servers.store_for(server, bucket)
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        out = os.path.join(self.dir, "s3.restored")
        yield Deferred.fromCoroutine(
            restore(store, "s3.example", out, run_in_thread=thread_runner(reactor))
        )
        self.assertEqual(
            [m[1] for m in _messages(out)], ["before", "during 0", "during 1", "during 2"]
        )


# -- helpers ---------------------------------------------------------------------------------------


def _bucket_keys(bucket: str, host: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(bucket):
        for name in names:
            if host in dirpath or host in name:
                out.append(os.path.join(dirpath, name))
    return out


def _move(src: str, dst: str, suffixes: tuple[str, ...]) -> None:
    for suffix in suffixes:
        if os.path.exists(src + suffix):
            os.rename(src + suffix, dst + suffix)


def _messages(db: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT room, body FROM messages ORDER BY id").fetchall()
    finally:
        conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class _WS:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()


def _open_websocket(port: int, host: str, path: str) -> _WS:
    """A raw WebSocket handshake through the router; the connection stays open until close()."""
    import base64

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"closed during the handshake: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return _WS(sock)


class TwistdDrainTests(_Harness):
    """SIGTERM to a real ``twistd lchat`` process: every awake space flushed and released."""

    @inlineCallbacks
    def test_sigterm_drains_every_awake_space(self):
        hosts = [f"t{i}.example" for i in range(5)]
        for host in hosts:
            self.add_space(host)
        port = s3servers.free_ports(1)[0]
        with open(self.env, "a") as f:
            f.write(
                f"LCHAT_HTTP_ADDR=127.0.0.1:{port}\nLCHAT_HTTPS_ADDR=off\n"
                f"LCHAT_SPACE_COMMAND={SPACE}\nLCHAT_HIBERNATE_BUCKET=file:{self.bucket}\n"
                f"LCHAT_HIBERNATE_IDLE=60s\n"
            )
        log_path = os.path.join(self.dir, "router.log")
        router = spawn_router(self.env, log_path)

        def kill() -> None:
            if router.poll() is None:
                router.kill()
                router.wait()
            kill_spaces_under(self.dir)  # what a SIGKILLed router leaves behind

        self.addCleanup(kill)
        self.port = port
        yield self.wait_for(lambda: _port_open(port) or router.poll() is not None)
        self.assertIsNone(router.poll(), open(log_path).read())
        results = yield DeferredList(
            [
                self.request(h, "/api/rooms/r/messages", b"POST", json.dumps({"body": h}).encode())
                for h in hosts
            ],
            consumeErrors=True,
        )
        self.assertTrue(all(ok and value[0].code == 201 for ok, value in results), results)
        self.assertTrue(all(self.lock_exists(h) for h in hosts))
        router.send_signal(signal.SIGTERM)
        code = yield deferToThread(router.wait, 60)
        # twistd re-raises the signal it stopped on (systemd counts SIGTERM as a clean exit).
        self.assertIn(code, (0, -signal.SIGTERM), open(log_path).read())
        text = open(log_path).read()
        store = open_store(
            reactor, Where(f"file:{self.bucket}"), thread_runner(reactor), monotonic=time.monotonic
        )
        self.addCleanup(lambda: Deferred.fromCoroutine(store.close()))
        for host in hosts:
            self.assertIn(f"activator: {host} asleep (shutdown)", text)
            self.assertFalse(self.lock_exists(host), host)
            out = os.path.join(self.dir, f"{host}.restored")
            yield Deferred.fromCoroutine(
                restore(store, host, out, run_in_thread=thread_runner(reactor))
            )
            self.assertEqual([m[1] for m in _messages(out)], [host])


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True

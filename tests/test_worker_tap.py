"""``twistd lchat-worker``'s service tree (lchat.worker_tap), built in this process on the real
reactor with a real listening socket passed as its inherited one: it serves the registry's rows,
answers the control channel, installs the box's ticket key before it listens, points its
control-plane seams at the control process, and imports no control plane."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.python import usage
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from lchat import config, ticketkeys, unixhttp, worker_tap
from lchat.cli.dev_cert import make_dev_certs
from lchat.config import BoxConfig, ConfigError
from lchat.controlhop import HopActivator
from lchat.proxy.serve import bind
from lchat.registry import Registry, Route
from lchat.router import LocalSocket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Hello(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"hello from the service\n"


class WorkerTreeTests(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="wt", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.data = os.path.join(self.dir, "d")
        self.rundir = os.path.join(self.dir, "r")
        os.makedirs(self.data)
        os.makedirs(os.path.join(self.rundir, "workers"), mode=0o700)

    def config(self, **extra: str) -> BoxConfig:
        environ: dict[str, str] = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.rundir,
            "LCHAT_HTTP_ADDR": "tcp:0:interface=127.0.0.1",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_UNITS": "builtin",
            "LCHAT_WORKERS": "2",
            **extra,
        }
        cfg = config.load(env_file=os.devnull, environ=environ)
        registry = Registry(cfg.registry, clock=time.time)
        registry.migrate()  # (the control process's job, before it starts workers)
        return cfg

    def service_row(self, cfg: BoxConfig, host: str) -> None:
        """A service row ``host`` and its backend: a Twisted site on a unix socket."""
        path = os.path.join(self.rundir, f"{host}.sock")
        port = reactor.listenUNIX(path, Site(_Hello()))  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        Registry(cfg.registry, clock=time.time).insert(
            Route(host=host, kind="service", socket=path, status="ready")
        )

    def start(self, cfg: BoxConfig, socks: dict[str, socket.socket]) -> Any:
        service = worker_tap.build_worker(cfg, reactor, 1, socks, poll_interval=0.2)
        service.startService()
        self.addCleanup(service.stopService)
        return service

    @inlineCallbacks
    def channel(self, cfg: BoxConfig, method: str, path: str):
        answer = yield Deferred.fromCoroutine(
            unixhttp.request(reactor, worker_tap.worker_socket(cfg, 1), method, path)
        )
        return answer.status, json.loads(answer.body)

    @inlineCallbacks
    def test_serves_its_inherited_socket_and_answers_the_channel(self):
        cfg = self.config()
        self.service_row(cfg, "svc.test")
        sock = bind("tcp:0:interface=127.0.0.1", reuse_port=True)
        port = sock.getsockname()[1]
        self.start(cfg, {"http": sock})
        status, body = yield Deferred.fromCoroutine(_tcp_get(port, "svc.test"))
        self.assertEqual(status, 200)
        self.assertIn(b"hello from the service", body)
        code, status_body = yield self.channel(cfg, "GET", "/status")
        self.assertEqual(code, 200)
        self.assertEqual(status_body["slot"], 1)
        self.assertEqual(status_body["routes"], 1)
        self.assertEqual(status_body["pid"], os.getpid())
        # A row added meanwhile is served once the control process's reload push comes.
        Registry(cfg.registry, clock=time.time).insert(
            Route(host="other.test", kind="service", socket="/nonexistent", status="ready")
        )
        code, reloaded = yield self.channel(cfg, "POST", "/reload?reason=test")
        self.assertEqual((code, reloaded["routes"]), (200, 2))
        code, version = yield self.channel(cfg, "GET", "/api/version")
        self.assertEqual((code, version["slot"]), (200, 1))

    def test_sockets_that_do_not_match_its_settings_are_refused(self) -> None:
        cfg = self.config()  # plain HTTP proxies: an "http" socket, nothing else
        with self.assertRaises(ConfigError) as caught:
            worker_tap.build_worker(cfg, reactor, 1, {})
        self.assertIn("its settings serve ['http']", str(caught.exception))

    def test_hibernating_rows_go_to_the_control_processs_hop(self) -> None:
        bucket = os.path.join(self.dir, "bucket")
        os.makedirs(bucket)
        cfg = self.config(LCHAT_HIBERNATE_BUCKET=f"file:{bucket}")
        routes = _Table()
        router = worker_tap.worker_router(cfg, routes)  # type: ignore[arg-type]
        activator = router._activator
        self.assertIsInstance(activator, HopActivator)
        assert isinstance(activator, HopActivator)
        route = Route(host="sleepy.test", kind="instance", socket="/x.sock", hibernate=True)
        target = activator.route(route)
        self.assertIsInstance(target, LocalSocket)
        assert isinstance(target, LocalSocket)
        self.assertEqual(target.kind, "hop")
        self.assertEqual(target.path, os.path.join(self.rundir, "workers", "hop.sock"))
        self.assertIsNone(router._mesh)  # (no LCHAT_MESH_SELF)
        self.assertIsNone(router._acme_challenge)

    @inlineCallbacks
    def test_the_ticket_key_is_installed_before_it_listens(self):
        certs = os.path.join(self.dir, "certs")
        make_dev_certs(certs, ["tls.test"])
        cfg = self.config(
            LCHAT_HTTPS_ADDR="tcp:0:interface=127.0.0.1",
            LCHAT_HTTP_ADDR="off",
            LCHAT_ACME_DIRECTORY="off",
        )
        os.makedirs(cfg.acme_cache, exist_ok=True)
        shutil.copy(os.path.join(certs, "tls.test.pem"), os.path.join(cfg.acme_cache))
        ticketkeys.write(
            os.path.join(self.rundir, "workers", "tls-ticket.key"), ticketkeys.new_key()
        )
        before = REGISTRY.get_sample_value("lchat_tls_ticket_key_installs_total", {"outcome": "ok"})
        sock = bind("tcp:0:interface=127.0.0.1", reuse_port=True)
        service = worker_tap.build_worker(cfg, reactor, 1, {"https": sock})
        # Built, not started: the key is in already (load_initial), as are the certificates.
        after = REGISTRY.get_sample_value("lchat_tls_ticket_key_installs_total", {"outcome": "ok"})
        self.assertEqual(after, (before or 0) + 1)
        self.assertEqual(REGISTRY.get_sample_value("lchat_tls_ticket_key_shared"), 1.0)
        service.startService()
        yield service.stopService()

    def test_parse_fds(self) -> None:
        self.assertEqual(worker_tap.parse_fds("https=3,http=4"), {"https": 3, "http": 4})
        self.assertEqual(worker_tap.parse_fds("http=4"), {"http": 4})
        self.assertEqual(worker_tap.parse_fds(""), {})
        for bad in ("https=3,https=4", "ftp=3", "https", "https=x", "https=1"):
            with self.assertRaises(usage.UsageError, msg=bad):
                worker_tap.parse_fds(bad)

    def test_the_log_observer_tags_lines_with_the_slot(self) -> None:
        out = io.StringIO()
        observer = worker_tap.log_observer(out, ["twistd", "lchat-worker", "--slot", "2"])
        from twisted.logger import Logger, LogPublisher

        publisher = LogPublisher(observer)
        Logger(namespace="lchat.proxy", observer=publisher).info("hello {who}", who="there")
        self.assertIn("[w2 lchat.proxy#info] hello there", out.getvalue())


class WorkerImportsTests(TestCase):
    def test_a_worker_imports_no_control_plane(self) -> None:
        """A fresh interpreter importing the worker's tap loads no mesh, ACME, backup or
        hibernation module, nor an object store's client (config's bucket-URL parser,
        lchat.objstore.where, is all it needs of them): a worker's memory is the data plane's."""
        program = (
            "import sys, lchat.worker_tap\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('lchat.mesh', 'lchat.acme', "
            "'lchat.backup', 'lchat.hibernation', 'lchat.objstore.', 'lchat.buckets', "
            "'lchat.units', 'lchat.tap', 'lchat.workers', 'boto', 'botocore', 'josepy')) "
            "and m != 'lchat.objstore.where')\n"
            "print(' '.join(bad))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            timeout=60,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.strip(), "")


class _Table:
    table: Any = None


async def _tcp_get(port: int, host: str) -> tuple[int, bytes]:
    """One HTTP/1.0 GET to 127.0.0.1:``port`` for ``host``: (status, body)."""
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
    from twisted.internet.protocol import Protocol

    class _Read(Protocol):
        def __init__(self) -> None:
            self.data = b""
            self.done: Deferred[bytes] = Deferred()

        def dataReceived(self, data: bytes) -> None:
            self.data += data

        def connectionLost(self, reason: object = None) -> None:
            self.done.callback(self.data)

    proto = _Read()
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), proto)
    assert proto.transport is not None
    proto.transport.write(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    response = await proto.done
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body

"""The whole router as twistd builds it: real registry, real children, real sockets."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

from twisted.application.service import MultiService
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers

from lchat import config, unixhttp
from lchat.admin import AlreadyRunning
from lchat.config import BoxConfig
from lchat.listener import Listener
from lchat.proxy.serve import FrontListener
from lchat.redirect import RedirectToHTTPS
from lchat.registry import Registry, Route
from lchat.routesource import RouteSource
from lchat.tap import build_service, listening_ports
from lchat.workerpool import WorkerPool
from lchat.workers import SlotSockets, build_control, worker_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space"


def _complete(response: bytes) -> bool:
    """``response`` holds a whole HTTP response with a Content-Length."""
    head, found, body = response.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class _Box(TestCase):
    """A data and a run directory, and the router's settings on them."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.data = os.path.join(self.dir, "d")
        self.rundir = os.path.join(self.dir, "r")
        os.mkdir(self.data)
        self.env = os.path.join(self.dir, "router.env")
        with open(self.env, "w") as f:
            f.write(
                f"LCHAT_DATA_DIR={self.data}\nLCHAT_RUN_DIR={self.rundir}\nLCHAT_UNITS=builtin\n"
            )

    def config(self, **extra: str) -> BoxConfig:
        flags = {
            "LCHAT_HTTP_ADDR": "tcp:0:interface=127.0.0.1",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_SPACE_COMMAND": SPACE,
        }
        flags.update(extra)
        environ = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", "")}
        return config.load(env_file=self.env, environ=environ, flags=flags)


class RouterTests(_Box):
    """One router per test, started as twistd would, on the real reactor."""

    def add_space(self, host: str, token: str = "t" * 32) -> Route:
        registry = Registry(self.config().registry, clock=time.time)
        registry.migrate()
        env_file = os.path.join(self.data, f"{host}.env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"LCHAT_ADMIN_TOKEN={token}\n".encode())
        os.close(fd)
        return registry.insert(
            Route(host=host, kind="instance", socket=os.path.join(self.rundir, f"{host}.sock"))
        )

    def start(self, cfg: BoxConfig | None = None, poll: float = 0.2) -> Any:
        cfg = cfg or self.config()
        service = build_service(cfg, reactor, poll_interval=poll)
        service.startService()
        self.addCleanup(service.stopService)
        ports: list[Any] = listening_ports(service)
        tcp = [p for p in ports if hasattr(p.getHost(), "port")]
        self.tls_port = next((p.getHost().port for p in tcp if getattr(p, "secure", False)), None)
        self.port = next(p.getHost().port for p in tcp if not getattr(p, "secure", False))
        self.cfg = cfg
        self.routes = next(s for s in service if isinstance(s, RouteSource))
        return service

    @inlineCallbacks
    def wait_for(self, predicate: Any, timeout: float = 20.0):
        for _ in range(int(timeout / 0.1)):
            result = predicate()
            if result:
                return result
            yield sleep(0.1)
        self.fail(f"timed out waiting for {predicate}")

    def row(self, host: str) -> Route | None:
        """The row as the running router sees it (registry written, table reloaded)."""
        return self.routes.table.get(host)

    @inlineCallbacks
    def get(self, host: str, path: str = "/api/version"):
        response = yield Agent(reactor).request(
            b"GET",
            f"http://127.0.0.1:{self.port}{path}".encode(),
            Headers({b"host": [host.encode()]}),
        )
        body = yield readBody(response)
        return response.code, body

    @inlineCallbacks
    def admin(self, method: str, path: str):
        response = yield Deferred.fromCoroutine(
            unixhttp.request(reactor, self.cfg.admin_socket, method, path)
        )
        return response

    @inlineCallbacks
    def test_serves_a_space_it_runs_and_marks_it_ready(self):
        self.add_space("chat.example.com")
        self.start()
        yield self.wait_for(lambda: (r := self.row("chat.example.com")) and r.status == "ready")
        code, body = yield self.get("chat.example.com")
        self.assertEqual(code, 200)
        self.assertIn("version", json.loads(body))
        code, _ = yield self.get("nobody.example.com")
        self.assertEqual(code, 404)

        status = yield self.admin("GET", "/status")
        doc = json.loads(status.body)
        self.assertEqual(doc["routes"], 1)
        self.assertEqual(doc["units"], "builtin")
        self.assertEqual(doc["hosts"]["chat.example.com"]["status"], "ready")
        self.assertEqual(doc["hosts"]["chat.example.com"]["process"]["state"], "ready")
        self.assertEqual(stat.S_IMODE(os.stat(self.cfg.admin_socket).st_mode), 0o600)
        metrics = yield self.admin("GET", "/metrics")
        self.assertIn(b"lchat_routes", metrics.body)
        self.assertIn(b"lchat_registry_reloads_total", metrics.body)

    @inlineCallbacks
    def test_a_missing_binary_is_a_failed_row_not_a_crashed_router(self):
        self.add_space("good.example.com")
        self.add_space("bad.example.com")
        cfg = self.config(LCHAT_SPACE_COMMAND=f"{self.dir}/no-such-binary-{{host}}")
        self.start(cfg)
        row = yield self.wait_for(
            lambda: (r := self.row("bad.example.com")) and r.status == "failed" and r
        )
        self.assertIn("no-such-binary-bad.example.com", row.last_error)
        code, _ = yield self.get("bad.example.com")
        self.assertEqual(code, 503)
        status = yield self.admin("GET", "/status")
        self.assertEqual(json.loads(status.body)["hosts"]["bad.example.com"]["status"], "failed")

    @inlineCallbacks
    def test_a_space_that_exits_at_once_is_failed_with_its_error(self):
        script = os.path.join(self.dir, "crash")
        with open(script, "w") as f:
            f.write("#!/bin/sh\necho 'database is on fire' >&2\nexit 3\n")
        os.chmod(script, 0o755)
        self.add_space("crash.example.com")
        self.start(self.config(LCHAT_SPACE_COMMAND=script))
        row = yield self.wait_for(
            lambda: (r := self.row("crash.example.com")) and r.status == "failed" and r, timeout=30
        )
        self.assertIn("database is on fire", row.last_error)

    @inlineCallbacks
    def test_a_world_readable_env_file_is_refused(self):
        self.add_space("open.example.com")
        os.chmod(os.path.join(self.data, "open.example.com.env"), 0o644)
        self.start()
        row = yield self.wait_for(
            lambda: (r := self.row("open.example.com")) and r.status == "failed" and r
        )
        self.assertIn("chmod 600", row.last_error)

    @inlineCallbacks
    def test_reload_by_poll_picks_up_a_new_row_and_stops_a_removed_one(self):
        self.start(poll=0.2)
        self.add_space("late.example.com")
        yield self.wait_for(lambda: (r := self.row("late.example.com")) and r.status == "ready")
        code, _ = yield self.get("late.example.com")
        self.assertEqual(code, 200)
        Registry(self.cfg.registry, clock=time.time).delete("late.example.com")
        yield self.wait_for(
            lambda: not os.path.exists(os.path.join(self.rundir, "late.example.com.sock"))
        )
        code, _ = yield self.get("late.example.com")
        self.assertEqual(code, 404)

    @inlineCallbacks
    def test_reload_by_sighup_and_by_admin_api(self):
        self.start(poll=3600)  # only an explicit reload can notice the change
        routes = self.routes
        backend = os.path.join(self.rundir, "svc.sock")
        registry = Registry(self.cfg.registry, clock=time.time)
        registry.insert(Route("svc.example.com", "service", backend, status="ready"))
        code, _ = yield self.get("svc.example.com")
        self.assertEqual(code, 404)
        os.kill(os.getpid(), signal.SIGHUP)
        yield self.wait_for(lambda: len(routes.table) == 1)
        code, _ = yield self.get("svc.example.com")
        self.assertEqual(code, 502)  # known now; nothing listens on its socket

        registry.delete("svc.example.com")
        response = yield self.admin("POST", "/reload")
        self.assertEqual(response.status, 200)
        self.assertEqual(json.loads(response.body), {"routes": 0})
        code, _ = yield self.get("svc.example.com")
        self.assertEqual(code, 404)

    @inlineCallbacks
    def test_https_with_sni_and_the_port_80_redirect(self):
        from lchat.cli.main import main as lchat_main

        self.add_space("chat.example.com")
        acme = os.path.join(self.data, "acme")
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(lchat_main(["dev-cert", "--out", acme, "chat.example.com"]), 0)
        self.start(self.config(LCHAT_HTTPS_ADDR="tcp:0:interface=127.0.0.1"))
        yield self.wait_for(lambda: (r := self.row("chat.example.com")) and r.status == "ready")

        def fetch_tls() -> tuple[int, bytes]:
            context = ssl.create_default_context(cafile=os.path.join(acme, "dev-ca.pem"))
            raw = socket.create_connection(("127.0.0.1", self.tls_port), timeout=10)
            with context.wrap_socket(raw, server_hostname="chat.example.com") as conn:
                conn.sendall(
                    b"GET /api/version HTTP/1.1\r\nHost: chat.example.com\r\n"
                    b"Connection: close\r\n\r\n"
                )
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            return int(head.split()[1]), body

        from twisted.internet.threads import deferToThread

        status, body = yield deferToThread(fetch_tls)
        self.assertEqual(status, 200)
        self.assertIn("version", json.loads(body))
        code, _ = yield self.get("chat.example.com", "/api/version?x=1")
        self.assertEqual(code, 301)

    @inlineCallbacks
    def test_the_drain_waits_for_a_tls_handshake_in_progress(self):
        """A client whose TLS handshake is under way when the router starts to drain (one the
        drain accepted from the kernel's queue, say) gets its answer: the front door's drain
        waits for it within the grace, rather than letting the process exit under it."""
        from lchat.cli.main import main as lchat_main

        self.add_space("chat.example.com")
        acme = os.path.join(self.data, "acme")
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(lchat_main(["dev-cert", "--out", acme, "chat.example.com"]), 0)
        service = self.start(self.config(LCHAT_HTTPS_ADDR="tcp:0:interface=127.0.0.1"))
        yield self.wait_for(lambda: (r := self.row("chat.example.com")) and r.status == "ready")
        context = ssl.create_default_context(cafile=os.path.join(acme, "dev-ca.pem"))
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_hostname="chat.example.com")
        raw = socket.create_connection(("127.0.0.1", self.tls_port), timeout=10)
        self.addCleanup(raw.close)

        def handshake_but_the_last_flight() -> None:
            while True:
                try:
                    tls.do_handshake()
                    return  # ours is done; the server still waits for our Finished
                except ssl.SSLWantReadError:
                    if outgoing.pending:
                        raw.sendall(outgoing.read())
                    incoming.write(raw.recv(65536))

        def finish_and_ask() -> bytes:
            tls.write(b"GET /api/version HTTP/1.1\r\nHost: chat.example.com\r\n\r\n")
            raw.sendall(outgoing.read())
            data = b""
            while not _complete(data):
                chunk = raw.recv(65536)
                if not chunk:
                    break
                incoming.write(chunk)
                try:
                    while piece := tls.read(65536):
                        data += piece
                except ssl.SSLWantReadError:
                    continue
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    break
            raw.close()  # (not waiting for the router's close: the drain waits for ours)
            return data

        from twisted.internet.threads import deferToThread

        yield deferToThread(handshake_but_the_last_flight)
        drained = service.getServiceNamed("front-door").stopService()
        yield sleep(0.5)
        self.assertFalse(drained.called, "the drain did not wait for the handshake")
        answer = yield deferToThread(finish_and_ask)
        self.assertTrue(answer.startswith(b"HTTP/1.1 200 "), answer[:200])
        self.assertIn(b"connection: close", answer.lower())  # draining: no keep-alive
        yield drained

    @inlineCallbacks
    def test_a_file_bucket_is_probed_at_start(self):
        bucket = os.path.join(self.dir, "bucket")
        service = self.start(self.config(LCHAT_HIBERNATE_BUCKET=f"file:{bucket}"))
        hibernation = service.getServiceNamed("hibernation")
        check = hibernation.check
        yield check.checked
        self.assertFalse(hasattr(check, "failed"))
        self.assertTrue(os.path.isdir(bucket))  # created, written, and the probe deleted again

    def test_a_second_router_on_the_same_run_dir_refuses(self) -> None:
        self.start()
        self.assertRaises(AlreadyRunning, build_service, self.config(), reactor)

    def test_stale_admin_socket_is_replaced(self) -> None:
        import socket

        os.makedirs(self.rundir)
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(os.path.join(self.rundir, "router.sock"))
        stale.close()  # the file stays, nobody listens
        service = build_service(self.config(), reactor)
        service.startService()
        return service.stopService()


def _walk(service: Any) -> list[Any]:
    """``service`` and every service under it."""
    found = [service]
    if isinstance(service, MultiService):
        for child in service:
            found.extend(_walk(child))
    return found


class WorkersTreeTests(_Box):
    """LCHAT_WORKERS: 1 builds today's single process; 2 a control process (built, not started:
    no worker process is spawned)."""

    def test_one_worker_is_the_single_process(self) -> None:
        cfg = self.config(LCHAT_WORKERS="1", LCHAT_HTTP_REDIRECT="off")
        self.assertEqual(cfg.workers, 1)
        tree = _walk(build_service(cfg, reactor))
        listeners = [s for s in tree if isinstance(s, FrontListener)]
        self.assertEqual([(s.address, s._reuse_port) for s in listeners], [(cfg.http_addr, False)])
        self.assertFalse(any(isinstance(s, WorkerPool | SlotSockets) for s in tree))
        self.assertFalse(os.path.exists(os.path.join(self.rundir, "workers")))

    def test_two_workers_build_a_control_process(self) -> None:
        cfg = self.config(LCHAT_WORKERS="2")
        tree = _walk(build_control(cfg, reactor))
        slots = next(s for s in tree if isinstance(s, SlotSockets))
        self.addCleanup(slots.close)
        # No public listener of its own: the one FrontListener is the hop door.
        listeners = [s for s in tree if isinstance(s, FrontListener)]
        hop = os.path.join(self.rundir, "workers", "hop.sock")
        self.assertEqual([s.address for s in listeners], [f"unix:{hop}"])
        self.assertTrue(listeners[0].factory.trusted_hop)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(hop)).st_mode), 0o700)
        # Two slots, each an SO_REUSEPORT socket on the one port :0 resolved to.
        socks = slots.sockets()["http"]
        self.assertEqual(len(socks), 2)
        ports = {s.getsockname()[1] for s in socks}
        self.assertEqual(len(ports), 1)
        self.assertNotIn(0, ports)
        for sock in socks:
            self.assertEqual(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT), 1)
        [port] = [p.getHost().port for p in slots.listening_ports()]
        self.assertEqual({port}, ports)
        # The pool's two workers: slot k's socket as its descriptor 4, its channel socket.
        pool = next(s for s in tree if isinstance(s, WorkerPool))
        self.assertEqual(pool.status()["wanted"], 2)
        specs = [worker_spec(cfg, k, slots.fds(k)) for k in (1, 2)]
        for k, spec in enumerate(specs, 1):
            self.assertEqual(spec.argv[-5:], ("lchat-worker", "--slot", str(k), "--fds", "http=4"))
            self.assertEqual(dict(spec.fds), {4: socks[k - 1].fileno()})
            self.assertEqual(
                spec.ready_socket, os.path.join(self.rundir, "workers", f"worker-{k}.sock")
            )
            self.assertEqual(spec.env["LCHAT_WORKERS"], "2")  # the control's own settings
            self.assertEqual(spec.env["LCHAT_HTTP_ADDR"], cfg.settings["LCHAT_HTTP_ADDR"])
            self.assertTrue(spec.inherit_output)

    def test_with_https_control_keeps_only_the_redirect_site(self) -> None:
        cfg = self.config(
            LCHAT_WORKERS="3",
            LCHAT_HTTPS_ADDR="tcp:0:interface=127.0.0.1",
            LCHAT_ACME_DIRECTORY="off",
        )
        tree = _walk(build_control(cfg, reactor))
        slots = next(s for s in tree if isinstance(s, SlotSockets))
        self.addCleanup(slots.close)
        # Plain HTTP redirects: the control process's own Twisted site; HTTPS is the workers'.
        self.assertEqual(list(slots.sockets()), ["https"])
        self.assertEqual(len(slots.sockets()["https"]), 3)
        self.assertEqual([p.secure for p in slots.listening_ports()], [True])
        sites = [s.factory for s in tree if isinstance(s, Listener)]
        redirects = [f for f in sites if isinstance(getattr(f, "resource", None), RedirectToHTTPS)]
        self.assertEqual(len(redirects), 1)
        self.assertEqual(worker_spec(cfg, 2, slots.fds(2)).argv[-1], "https=3")


class TwistdTests(TestCase):
    """The plugin as an operator meets it: through the twistd command line."""

    def twistd(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            # (one process: the default LCHAT_WORKERS=auto would start one a core)
            env={**os.environ, "PYTHONPATH": ROOT, "LCHAT_WORKERS": "1", **(env or {})},
            timeout=60,
        )

    def test_twistd_lists_the_plugin_and_documents_every_option(self) -> None:
        self.assertIn("lchat", self.twistd("--help").stdout)
        text = self.twistd("lchat", "--help").stdout
        for option in (
            "--env-file",
            "--registry",
            "--data-dir",
            "--run-dir",
            "--http",
            "--https",
            "--fallback-url",
            "--units",
            "--space-command",
        ):
            self.assertIn(option, text)

    def test_the_venvs_twistd_finds_both_plugins_from_any_directory(self) -> None:
        # What make install leaves (an editable install: no PYTHONPATH, not run from the checkout)
        # must find twisted/plugins as an installed wheel does: make run needs both.
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        if not os.path.exists(twistd):
            raise SkipTest(f"no twistd beside {sys.executable}")
        result = subprocess.run(
            [twistd, "--help"],
            capture_output=True,
            text=True,
            cwd="/",
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            timeout=60,
        )
        commands = {line.split()[0] for line in result.stdout.splitlines() if line[:4] == "    "}
        self.assertLessEqual({"lchat", "lchat-home"}, commands, result.stdout + result.stderr)

    def test_an_unusable_bucket_stops_the_router_naming_the_variable(self) -> None:
        d = tempfile.mkdtemp(prefix="tw", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = self.twistd(
            "-n",
            "--pidfile=",
            "lchat",
            "--data-dir",
            d,
            "--run-dir",
            d,
            "--http",
            "tcp:0:interface=127.0.0.1",
            "--https",
            "off",
            env={
                "LCHAT_HIBERNATE_BUCKET": "lchat-test",
                "LCHAT_HIBERNATE_ENDPOINT": f"http://127.0.0.1:{port}",
                "LCHAT_HIBERNATE_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
            },
        )
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        output = result.stdout + result.stderr
        self.assertIn("LCHAT_HIBERNATE_BUCKET=lchat-test: the bucket is not usable", output)

    def test_an_unusable_backup_bucket_stops_the_router_naming_the_variable(self) -> None:
        d = tempfile.mkdtemp(prefix="tw", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = self.twistd(
            "-n",
            "--pidfile=",
            "lchat",
            "--data-dir",
            d,
            "--run-dir",
            d,
            "--http",
            "tcp:0:interface=127.0.0.1",
            "--https",
            "off",
            env={
                "LCHAT_BACKUP_BUCKET": "fleet-backup",
                "LCHAT_BACKUP_ENDPOINT": f"http://127.0.0.1:{port}",
                "LCHAT_BACKUP_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
            },
        )
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        output = result.stdout + result.stderr
        self.assertIn("LCHAT_BACKUP_BUCKET=fleet-backup: the bucket is not usable", output)
        self.assertIn("LCHAT_BACKUP_ENDPOINT", output)

    def test_misconfiguration_fails_at_boot_naming_the_variable(self) -> None:
        d = tempfile.mkdtemp(prefix="tw", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        result = self.twistd(
            "-n",
            "--pidfile=",
            "lchat",
            "--data-dir",
            d,
            "--run-dir",
            d,
            env={"LCHAT_HIBERNATE_IDLE": "0s"},
        )
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("LCHAT_HIBERNATE_IDLE", result.stderr)
        self.assertNotIn("Traceback", result.stderr)

"""A box with worker processes (``LCHAT_WORKERS`` >= 2): what the admin API and ``lchat
instances`` say about them (in process), and the promises of issue 33 item 2 on real routers:
``twistd lchat`` with ``LCHAT_WORKERS=2`` (a control process and two ``twistd lchat-worker``),
a file bucket for hibernation, ``tests/slow_space.py`` behind a service row, the reference space
as a hibernating instance. One router serves the tests of :class:`WorkerBoxTests` in turn (the
last one drains it); :class:`ControlKilledTests` has its own."""

from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from prometheus_client import CONTENT_TYPE_LATEST
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from lchat import admin_client
from lchat.admin import AdminAPI, metrics_site
from lchat.cli.dev_cert import make_dev_certs
from lchat.cli.instances import _workers_summary
from lchat.reactors import installed
from lchat.registry import Registry, Route
from lchat.routesource import RouteSource
from lchat.threads import thread_runner
from tests.routerproc import ROOT, kill_spaces_under, spawn_router

SPACE = f"env PYTHONPATH={ROOT} {sys.executable} -m lchat.space"
SLOW_SPACE = os.path.join(ROOT, "tests", "slow_space.py")


def _request(method: bytes, path: bytes) -> Any:
    request: Any = DummyRequest([path[1:]])
    request.method = method
    request.path = path
    return request


async def _render(resource: Any, request: Any) -> tuple[int, bytes]:
    """Render ``request`` through ``resource`` and wait for it to finish."""
    result = resource.render(request)
    if isinstance(result, bytes):
        return request.responseCode or 200, result
    if not request.finished:
        await request.notifyFinish()
    return request.responseCode or 200, b"".join(request.written)


class AdminWithWorkersTests(TestCase):
    """The admin API's reload, metrics and status with the callables a control process gives."""

    def setUp(self) -> None:
        d = tempfile.mkdtemp(prefix="aw", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        registry = Registry(os.path.join(d, "registry.db"), clock=time.time)
        registry.migrate()
        self.routes = RouteSource(
            reactor, registry, registry.load(), run_in_thread=thread_runner(installed())
        )

    def admin(self, **options: Any) -> Any:
        return AdminAPI(reactor, self.routes, "builtin", **options).site().resource

    async def test_reload_answers_what_the_reload_callable_says(self) -> None:
        asked: list[str] = []

        def reload(reason: str) -> Deferred[dict[str, Any]]:
            asked.append(reason)
            return succeed({"routes": 0, "workers": {"current": 2, "of": 2, "behind": []}})

        code, body = await _render(self.admin(reload=reload), _request(b"POST", b"/reload"))
        self.assertEqual(code, 200)
        self.assertEqual(
            json.loads(body), {"routes": 0, "workers": {"current": 2, "of": 2, "behind": []}}
        )
        self.assertEqual(asked, ["admin API"])

    async def test_one_process_reload_is_its_table(self) -> None:
        code, body = await _render(self.admin(), _request(b"POST", b"/reload"))
        self.assertEqual((code, json.loads(body)), (200, {"routes": 0}))

    async def test_metrics_from_a_deferred_and_a_failure_is_a_500(self) -> None:
        resource = self.admin(metrics=lambda: succeed(b"merged 1\n"))
        request = _request(b"GET", b"/metrics")
        code, body = await _render(resource, request)
        self.assertEqual((code, body), (200, b"merged 1\n"))
        self.assertEqual(
            request.responseHeaders.getRawHeaders(b"content-type"), [CONTENT_TYPE_LATEST.encode()]
        )
        resource = self.admin(metrics=lambda: fail(RuntimeError("worker 2 garbled")))
        code, body = await _render(resource, _request(b"GET", b"/metrics"))
        self.assertEqual(code, 500)
        self.assertIn(b"worker 2 garbled", body)
        # LCHAT_METRICS_ADDR's site serves the same callable.
        site = metrics_site(lambda: succeed(b"merged 2\n"))
        code, body = await _render(site.resource, _request(b"GET", b"/metrics"))
        self.assertEqual((code, body), (200, b"merged 2\n"))

    def test_status_has_workers_only_when_given(self) -> None:
        workers = {"wanted": 2, "serving": 2, "list": []}
        with_workers = AdminAPI(reactor, self.routes, "builtin", workers=lambda: workers)
        self.assertEqual(with_workers.status()["workers"], workers)
        self.assertNotIn("workers", AdminAPI(reactor, self.routes, "builtin").status())


class _Scraped:
    """A pool whose scrape answers ``texts`` (slot -> text, or None: did not answer)."""

    def __init__(self, texts: dict[int, str | None]) -> None:
        self.texts = texts

    def scrape(self) -> Deferred[dict[int, str | None]]:
        return succeed(dict(self.texts))


class BoxScrapeTests(TestCase):
    async def test_garbage_from_a_worker_leaves_it_out_and_keeps_its_counters(self) -> None:
        from prometheus_client import CollectorRegistry

        from lchat.metricsmerge import MergedMetrics
        from lchat.workers import _scrape

        merged = MergedMetrics(CollectorRegistry())
        good = "# TYPE lchat_http_requests_total counter\nlchat_http_requests_total 3\n"
        gauge = "# TYPE lchat_http_connections gauge\nlchat_http_connections 2\n"
        pool: Any = _Scraped({1: good + gauge, 2: good})
        text = (await _scrape(pool, merged)).decode()
        self.assertIn("lchat_http_requests_total 6.0", text)
        self.assertIn("lchat_http_connections 2.0", text)
        # Worker 1 answers garbage, worker 2 does not answer: the scrape still succeeds; their
        # counters stay (not double counted), worker 1's gauge goes.
        pool.texts = {1: "not {prometheus", 2: None}
        text = (await _scrape(pool, merged)).decode()
        self.assertIn("lchat_http_requests_total 6.0", text)
        self.assertNotIn("lchat_http_connections 2.0", text)


class _SwappingRoutes:
    """A route source whose reload swaps the table (its subscribers told) before it answers."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[object, object], object]] = []
        self.table: list[str] = []

    def subscribe(self, listener: Callable[[object, object], object]) -> None:
        self.listeners.append(listener)

    def swap(self) -> None:
        old, self.table = self.table, [*self.table, "h"]
        for listener in self.listeners:
            listener(old, self.table)

    def reload(self, reason: str) -> Deferred[list[str]]:
        self.swap()
        return succeed(self.table)


class _CountingPool:
    def __init__(self) -> None:
        self.pushes = 0
        self.asked: list[str] = []

    def table_changed(self) -> None:
        self.pushes += 1

    def reload_all(self, reason: str) -> Deferred[dict[str, Any]]:
        self.asked.append(reason)
        return succeed({"current": 2, "of": 2, "behind": []})


class BoxReloadTests(TestCase):
    """A reload of the box asks each worker once (its acks waited for); a table swapped by
    anything else is pushed (it sent each worker two ``/reload``s: the swap's push, then the
    ask)."""

    def reload(self) -> tuple[Any, _SwappingRoutes, _CountingPool]:
        from lchat.workers import _BoxReload

        box, routes, pool = _BoxReload(), _SwappingRoutes(), _CountingPool()
        box.routes, box.pool = routes, pool  # type: ignore[assignment]
        routes.subscribe(lambda old, new: box.table_changed())
        return box, routes, pool

    def test_a_box_reload_asks_each_worker_once(self) -> None:
        box, _, pool = self.reload()
        answer = self.successResultOf(box.answer("SIGHUP"))
        self.assertEqual(answer["workers"], {"current": 2, "of": 2, "behind": []})
        self.assertEqual((pool.pushes, pool.asked), (0, ["SIGHUP"]))

    def test_a_swap_outside_a_reload_is_pushed(self) -> None:
        _, routes, pool = self.reload()
        routes.swap()  # (the registry poll found a change)
        self.assertEqual((pool.pushes, pool.asked), (1, []))


class WorkersLineTests(TestCase):
    """``lchat instances``' stderr line about the workers."""

    def entry(self, slot: int, state: str = "ready", **extra: Any) -> dict[str, Any]:
        return {
            "slot": slot,
            "state": state,
            "restarts": 0,
            "last_error": None,
            "routes_current": True,
            "certificates_current": None,
            **extra,
        }

    def test_all_serving(self) -> None:
        status = {"workers": {"wanted": 2, "serving": 2, "list": [self.entry(1), self.entry(2)]}}
        self.assertEqual(
            _workers_summary(status),
            "workers: 2 of 2 serving (LCHAT_WORKERS=2), on the current routes and certificates",
        )

    def test_what_is_wrong_is_named(self) -> None:
        down = self.entry(2, "backoff", restarts=3, last_error="killed by SIGKILL")
        behind = self.entry(1, routes_current=False)
        status = {"workers": {"wanted": 2, "serving": 1, "list": [behind, down]}}
        self.assertEqual(
            _workers_summary(status),
            "workers: 1 of 2 serving (LCHAT_WORKERS=2) \N{EM DASH} worker 1 behind on routes; "
            "worker 2 backoff (killed by SIGKILL; 3 restarts)",
        )

    def test_one_process_says_nothing(self) -> None:
        self.assertIsNone(_workers_summary({"hosts": {}}))
        self.assertIsNone(_workers_summary(None))


# -- real routers -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _until(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except (OSError, ValueError, KeyError, admin_client.Unreachable):
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in Prometheus ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


class WorkerBox:
    """A real ``twistd lchat`` with LCHAT_WORKERS=2 on 127.0.0.1, its directories and helpers."""

    def __init__(self, hibernate: bool = True, https: str | None = None) -> None:
        """``https``: a host to serve over HTTPS only, with a dev-cert certificate (its CA in
        ``self.ca``), instead of plain HTTP."""
        self.dir = tempfile.mkdtemp(prefix="wk", dir="/tmp")
        self.data = os.path.join(self.dir, "d")
        self.run = os.path.join(self.dir, "r")
        os.makedirs(self.data)
        os.makedirs(self.run)
        self.port = _free_port()
        self.env_file = os.path.join(self.dir, "router.env")
        self.log_path = os.path.join(self.dir, "router.log")
        self.admin = os.path.join(self.run, "router.sock")
        settings = {
            "LCHAT_DATA_DIR": self.data,
            "LCHAT_RUN_DIR": self.run,
            "LCHAT_HTTP_ADDR": f"127.0.0.1:{self.port}",
            "LCHAT_HTTPS_ADDR": "off",
            "LCHAT_UNITS": "builtin",
            "LCHAT_SPACE_COMMAND": SPACE,
        }
        self.ca = ""
        if https is not None:
            settings["LCHAT_HTTP_ADDR"] = "off"
            settings["LCHAT_HTTPS_ADDR"] = f"127.0.0.1:{self.port}"
            settings["LCHAT_ACME_DIRECTORY"] = "off"
            certs = os.path.join(self.dir, "certs")
            self.ca, _, _ = make_dev_certs(certs, [https])
            acme = os.path.join(self.data, "acme")
            os.makedirs(acme, mode=0o700)
            shutil.copy(os.path.join(certs, f"{https}.pem"), acme)
            os.chmod(os.path.join(acme, f"{https}.pem"), 0o600)
        if hibernate:
            bucket = os.path.join(self.dir, "bucket")
            os.makedirs(bucket)
            settings["LCHAT_HIBERNATE_BUCKET"] = f"file:{bucket}"
            settings["LCHAT_HIBERNATE_IDLE"] = "15m"  # nothing sleeps on its own meanwhile
        with open(self.env_file, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in settings.items()))
        self.backends: list[subprocess.Popen[bytes]] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = spawn_router(self.env_file, self.log_path, workers=2)
        _until("two ready workers", lambda: self.serving() == 2, 60)

    def cleanup(self) -> None:
        if not os.path.isdir(self.dir):
            return  # (cleaned up already)
        pids = []
        if self.proc is not None and self.proc.poll() is None:
            pids = self.worker_pids_now()
            self.proc.kill()
            self.proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for backend in self.backends:
            backend.kill()
            backend.wait()
        kill_spaces_under(self.dir)
        shutil.rmtree(self.dir, True)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    # -- asking it

    def status(self) -> dict[str, Any]:
        answer = admin_client.status(self.admin, timeout=5)
        assert answer.status == 200, answer
        return dict(answer.json())

    def workers(self) -> list[dict[str, Any]]:
        return list(self.status()["workers"]["list"])

    def serving(self) -> int:
        return int(self.status()["workers"]["serving"])

    def worker_pids_now(self) -> list[int]:
        try:
            return [w["pid"] for w in self.workers() if w.get("pid")]
        except (OSError, admin_client.Unreachable, KeyError, AssertionError):
            return []

    def metrics(self) -> str:
        answer = admin_client.request(self.admin, "GET", "/metrics", timeout=10)
        assert answer.status == 200, answer
        return answer.body.decode()

    def lchat(self, *argv: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
        env["PYTHONPATH"] = ROOT
        return subprocess.run(
            [sys.executable, "-m", "lchat.cli", *argv, "--env-file", self.env_file],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def get(self, host: str, path: str = "/api/version", timeout: float = 15) -> tuple[int, Any]:
        """One request on a fresh connection: (status, response headers)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers={"Host": host})
            response = conn.getresponse()
            response.read()
            return response.status, response.headers
        finally:
            conn.close()

    def slow_backend(self, name: str, seconds: float = 1.0) -> str:
        """tests/slow_space.py on ``<dir>/<name>.sock`` (``/slow`` takes ``seconds``)."""
        path = os.path.join(self.dir, f"{name}.sock")
        env = {
            **os.environ,
            "LCHAT_SOCKET": path,
            "LCHAT_DB": os.path.join(self.dir, f"{name}.db"),
            "LCHAT_SLOW": str(seconds),
        }
        self.backends.append(
            subprocess.Popen([sys.executable, SLOW_SPACE], env=env, stdin=subprocess.DEVNULL)
        )
        _until(f"{name}'s socket", lambda: os.path.exists(path), 15)
        return path


def _concurrently(n: int, call: Callable[[], Any]) -> list[Any]:
    """``call()`` in ``n`` threads started together; their results (or exceptions)."""
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


class WorkerBoxTests(TestCase):
    """Issue 33 item 2's promises on one real box of two workers (tests run in name order; the
    last drains the box)."""

    _shared: ClassVar[tuple[WorkerBox, str] | None] = None

    def setUp(self) -> None:
        """The shared box, started by the first test that runs (cleaned up at exit, if the
        drain test did not run)."""
        if WorkerBoxTests._shared is None:
            box = WorkerBox()
            atexit.register(box.cleanup)
            try:
                box.start()
                service = box.slow_backend("svc", seconds=2.5)
                added = box.lchat("add-service", "svc.test", "--socket", service)
                assert added.returncode == 0, added.stderr
            except BaseException:
                log = box.log()
                box.cleanup()
                raise AssertionError(f"the box did not start:\n{log}") from None
            WorkerBoxTests._shared = (box, service)
        self.box, self.service = WorkerBoxTests._shared

    def accepted(self) -> dict[int, int]:
        return {w["slot"]: w["accepted"] or 0 for w in self.box.workers()}

    def settle(self) -> dict[int, int]:
        """The workers' accepted counts once the watchdog has asked them since (2 s rounds)."""
        time.sleep(2.5)
        return self.accepted()

    def test_1_spread_and_one_scrape(self) -> None:
        box = self.box
        before = box.metrics()
        accepted = self.accepted()
        statuses = [box.get("svc.test")[0] for _ in range(200)]
        self.assertEqual(statuses, [200] * 200)
        after = self.settle()
        served = {slot: after[slot] - accepted.get(slot, 0) for slot in after}
        self.assertEqual(sum(served.values()), 200, served)
        for slot, n in served.items():  # the kernel's hash: each well over 20 %
            self.assertGreaterEqual(n, 40, f"worker {slot} served {n} of 200: {served}")
        # One scrape of the control process counts every worker's requests.
        counted = _sample(box.metrics(), "lchat_http_requests_total", host_class="service")
        was = _sample(before, "lchat_http_requests_total", host_class="service")
        self.assertEqual(counted - was, 200)
        text = box.metrics()
        self.assertEqual(_sample(text, "lchat_workers", state="ready"), 2)
        self.assertIn('process_resident_memory_bytes{worker="1"}', text)
        # lchat instances says so, on stderr.
        listing = box.lchat("instances")
        self.assertEqual(listing.returncode, 0, listing.stderr)
        self.assertIn("workers: 2 of 2 serving (LCHAT_WORKERS=2)", listing.stderr)

    def test_2_reload_reaches_every_worker(self) -> None:
        box = self.box
        added = box.lchat("add-service", "new.test", "--socket", self.service)
        self.assertEqual(added.returncode, 0, added.stderr)
        # The command returned once every worker acknowledged: no worker answers 404 now.
        statuses = [box.get("new.test")[0] for _ in range(50)]
        self.assertEqual(statuses, [200] * 50)
        # A write behind the router's back, then SIGHUP to the control process alone: both
        # workers serve it within a second (their own polls would take 2 s).
        Registry(os.path.join(box.data, "registry.db"), clock=time.time).insert(
            Route(host="hup.test", kind="service", socket=self.service, status="ready")
        )
        assert box.proc is not None
        os.kill(box.proc.pid, signal.SIGHUP)
        time.sleep(1.0)
        statuses = [box.get("hup.test")[0] for _ in range(30)]
        self.assertEqual(statuses, [200] * 30)
        workers = box.workers()
        self.assertTrue(all(w["routes_current"] is not False for w in workers), workers)

    def test_3_wake_through_any_worker_coalesces(self) -> None:
        box = self.box
        added = box.lchat("add-instance", "sleepy.test", "--hibernate")
        self.assertEqual(added.returncode, 0, added.stderr)
        self.assertEqual(box.status()["hosts"]["sleepy.test"]["state"], "asleep")
        before = box.metrics()
        accepted = self.accepted()
        answers = _concurrently(20, lambda: box.get("sleepy.test", timeout=60))
        for answer in answers:
            self.assertIsInstance(answer, tuple, answer)
            status, headers = answer
            self.assertEqual(status, 200)
            self.assertIsNotNone(headers.get("X-Lchat-Wake"), headers)
        after = self.settle()
        self.assertTrue(all(after[s] > accepted.get(s, 0) for s in after), (accepted, after))
        text = box.metrics()
        wakes = _sample(text, "lchat_wakes_total", outcome="ok")
        self.assertEqual(wakes - _sample(before, "lchat_wakes_total", outcome="ok"), 1)
        coalesced = _sample(text, "lchat_wake_coalesced_total")
        self.assertEqual(coalesced - _sample(before, "lchat_wake_coalesced_total"), 19)
        # The hop's requests are counted once, by the control process, as the instance's.
        self.assertEqual(_sample(text, "lchat_http_requests_total", host_class="hop"), 0)

    def test_4_killed_worker_replaced(self) -> None:
        box = self.box
        before = _sample(box.metrics(), "lchat_http_requests_total", host_class="service")
        [one] = [w for w in box.workers() if w["slot"] == 1]
        os.kill(one["pid"], signal.SIGKILL)
        # Meanwhile every fresh connection is served: queued on slot 1's socket (which the
        # control process holds) until the replacement takes it, or by worker 2.
        statuses = [box.get("svc.test", timeout=20)[0] for _ in range(30)]
        self.assertEqual(statuses, [200] * 30)
        again = _until(
            "worker 1 replaced",
            lambda: [
                w
                for w in box.workers()
                if w["slot"] == 1 and w["state"] == "ready" and w["pid"] != one["pid"]
            ],
            10,
        )[0]
        self.assertEqual(again["restarts"], one["restarts"] + 1)
        self.assertFalse(_alive(one["pid"]))
        # The box's counter carried worker 1's old run: it did not go down.
        after = _sample(box.metrics(), "lchat_http_requests_total", host_class="service")
        self.assertGreaterEqual(after, before + 30)

    def test_5_hung_worker_killed_by_the_watchdog(self) -> None:
        box = self.box
        before = _sample(box.metrics(), "lchat_worker_kills_total", why="hung")
        [two] = [w for w in box.workers() if w["slot"] == 2]
        os.kill(two["pid"], signal.SIGSTOP)
        _until(
            "worker 2 killed and replaced",
            lambda: [
                w
                for w in box.workers()
                if w["slot"] == 2 and w["state"] == "ready" and w["pid"] != two["pid"]
            ],
            25,
            every=0.5,
        )
        self.assertFalse(_alive(two["pid"]))
        after = _sample(box.metrics(), "lchat_worker_kills_total", why="hung")
        self.assertEqual(after - before, 1)
        self.assertIn("worker 2 did not answer for", box.log())

    def test_6_drain(self) -> None:
        box = self.box
        assert box.proc is not None
        pids = [box.proc.pid, *box.worker_pids_now()]
        self.assertEqual(len(pids), 3)
        slow: list[Any] = []
        request = threading.Thread(target=lambda: slow.append(box.get("svc.test", "/slow")))
        request.start()
        time.sleep(0.5)  # (in flight in a worker: the backend answers after 2.5 s)
        box.proc.send_signal(signal.SIGTERM)  # systemd's KillMode=mixed: control alone
        request.join(30)
        self.assertEqual(len(slow), 1)
        self.assertEqual(slow[0][0], 200)
        _until("every process gone", lambda: not any(_alive(pid) for pid in pids), 20)
        self.assertEqual(box.proc.wait(5), -signal.SIGTERM)  # (twistd ends as it was told)
        with self.assertRaises(OSError):  # nothing listens on the port any more
            socket.create_connection(("127.0.0.1", box.port), timeout=2).close()
        self.assertNotIn("Traceback", box.log())
        box.cleanup()


class ControlKilledTests(TestCase):
    def test_workers_exit_when_the_control_process_is_killed(self) -> None:
        box = WorkerBox(hibernate=False)
        self.addCleanup(box.cleanup)
        box.start()
        pids = box.worker_pids_now()
        self.assertEqual(len(pids), 2)
        assert box.proc is not None
        box.proc.kill()
        box.proc.wait()
        # PR_SET_PDEATHSIG: each worker gets SIGTERM and drains (nothing in flight: at once).
        _until("both workers gone", lambda: not any(_alive(pid) for pid in pids), 10)
        with self.assertRaises(OSError):
            socket.create_connection(("127.0.0.1", box.port), timeout=2).close()


class TicketsAcrossWorkersTests(TestCase):
    def test_a_client_resumes_on_either_worker(self) -> None:
        """HTTPS through two workers: a client reconnecting with its newest session resumes every
        time, whichever worker the kernel hands the connection to (they share the control
        process's ticket key; each worker's own key would fail about half of them)."""
        box = WorkerBox(hibernate=False, https="tls.test")
        self.addCleanup(box.cleanup)
        box.start()
        added = box.lchat("add-service", "tls.test", "--socket", box.slow_backend("svc"))
        self.assertEqual(added.returncode, 0, added.stderr)
        context = ssl.create_default_context(cafile=box.ca)
        session = None
        resumed = []
        accepted = {w["slot"]: w["accepted"] or 0 for w in box.workers()}
        for _ in range(24):
            with socket.create_connection(("127.0.0.1", box.port), timeout=10) as raw:
                with context.wrap_socket(raw, server_hostname="tls.test", session=session) as tls:
                    tls.sendall(b"GET /api/version HTTP/1.1\r\nHost: tls.test\r\n\r\n")
                    self.assertTrue(tls.recv(65536).startswith(b"HTTP/1.1 200 "))
                    resumed.append(tls.session_reused)
                    session = tls.session  # (TLS 1.3: the ticket came after the handshake)
        self.assertEqual(resumed, [False] + [True] * 23)
        time.sleep(2.5)  # (the watchdog's next round)
        served = {w["slot"]: (w["accepted"] or 0) - accepted[w["slot"]] for w in box.workers()}
        self.assertTrue(all(n > 0 for n in served.values()), served)
        text = box.metrics()
        self.assertGreaterEqual(_sample(text, "lchat_tls_handshakes_total", resumed="yes"), 23)

"""Mesh: forwarding overhead, failover after a graceful stop and after kill -9, and what membership
costs in S3 requests — three real routers, one moto bucket, HTTPS verified against a test CA.

    .venv/bin/python bench/mesh.py [--requests 2000] [--fresh 100] [--graceful 5] [--kills 3]
        [--heartbeat 1] [--dead-after 3] [--lease-ttl 5] [--idle 30] [--poll 0.025]
        [--clients 32] [--default-hb-trials 3] [--patched-trials 3] [--patched-retry 0]
        [--default-hb-kills 5] [--lease-hour 30] [--only SECTION,...] [--keep]

(~13 min with the defaults on 2 cores, of which ~6 for 6. and 7.: ``--only
default-kills,lease-requests`` runs just those; needs the test extras — boto3, moto — as
tests/s3servers.py does: .venv and /tmp/venv have them.) Prints a Markdown section and writes it to
/tmp/mesh-section.md. ``--only`` takes any of forwarding, graceful, kills, membership,
default-graceful, patched, lease-requests, default-kills (all by default).

What runs (the set-up of tests/test_mesh.py): a moto server (tests/s3servers.py), a test CA with a
``*.mesh.test`` wildcard certificate (``lchat dev-cert``'s ``make_dev_certs``) copied into each
box's ACME cache, and three ``twistd -n --pidfile= lchat --env-file <box>/router.env`` on
127.0.0.2-4 with ``LCHAT_HTTPS_ADDR`` only, ``LCHAT_UNITS=builtin``, the reference space as
``LCHAT_SPACE_COMMAND``, ``LCHAT_MESH_SELF=https://<address>:<port>``, ``LCHAT_MESH_DOMAINS=mesh.test``,
``LCHAT_MESH_CA_FILE`` = the test CA, ``LCHAT_MESH_HEARTBEAT``/``DEAD_AFTER``/``LCHAT_LEASE_TTL``
from the options, and every in-scope hibernating row inserted into each box's registry before
it starts (what route replication would have done). Each router runs through this script
(``--child-router``), which only adds a log observer writing every event as a JSON line with its
``time.time()`` stamp (and text lines with milliseconds): the failover timelines below are read
from those events, on the same clock as the client's.

1. **Forwarding**: a space awake on its owner; ``GET /api/version`` over a kept-alive HTTPS
   connection straight to the owner, and over another to a box that does not own it (which
   forwards over TLS to the owner, pooled), alternating one by one, ``--requests`` of each after
   a warm-up; then ``--fresh`` of each on a new connection (TCP + TLS handshake) per request.
   Latency = request sent to body read, on the client.
2. **Graceful failover**, ``--graceful`` trials, each on its own space (so every survivor's wake
   is a cold one, restored from the bucket): a message is posted (any box; it lands on the owner);
   ``--clients`` poller threads open a connection each to one survivor and make one request
   through it (clients that were there before); then the owner gets SIGTERM, and from that
   instant a ``GET /api/rooms/r/messages`` goes to that survivor every ``--poll`` seconds on a
   free thread's kept-alive connection (a new thread and connection when all are busy), each
   with a 20 s timeout, without waiting for earlier ones, until an answer is a 200 holding the
   message. Time to serving = that answer's arrival. The stopped box is then started again on a
   new port (a new member URL, so that requests still re-dialling the old address cannot reach the
   new process); the requests still out are waited for (at most 16 s), the same space is woken
   once more with the admin API's ``POST /wake`` on the survivor that did not wake it (a cold wake
   with no failover around it, for comparison), and the next trial waits until every box sees
   three members again. Each survivor's ``lchat_mesh_forwards_total``,
   ``lchat_activator_unavailable_total``, ``lchat_upstream_dial_retries_total`` and S3 counters
   are read before the signal and after the first served answer.
3. **kill -9 failover**, ``--kills`` trials: the same, 1.5 s after the post (the stream class
   ships within ~1 s), with SIGKILL. The lease's and the heartbeat's ``Last-Modified`` are read
   straight from moto after the kill, to say when the lease could be taken over (floor(LM) + 1 s +
   ceil(TTL), lchat/lease.py) and when the member counts as dead (LM + dead_after). The orphaned
   space process is killed by its pid afterwards.
4. **Membership S3 requests**: every space put to sleep, then ``--idle`` seconds with nothing
   awake; each router's ``lchat_s3_requests_total`` (admin ``GET /metrics``) before and after, by
   operation, per beat, and extrapolated to the default 15 s heartbeat.
5. **Graceful failover at the default heartbeat**, ``--default-hb-trials``: the three routers
   restarted with ``LCHAT_MESH_HEARTBEAT=15s``/``DEAD_AFTER=45s`` and the trials of 2. again
   (``--patched-trials``: once more with ``PEER_DIAL_RETRY`` patched in the routers).
6. **Lease requests per awake space-hour** (issue 18), in a scaled hour: ``--lease-hour`` seconds
   stand for one hour and every TTL is scaled by the same factor (30 s: 2 h → 60 s, 15 min → 7.5
   s), so a count made in one scaled hour is the count of a real one (renewals every TTL/3, one
   acquire and one release per wake: all times scale together). The routers are restarted (the
   ``--heartbeat`` mesh) twice: with the mesh default TTL (``LCHAT_LEASE_TTL`` unset on a mesh box:
   2 h) scaled, and with the per-space renewals every box had before (15 min) scaled, on the same
   mesh. Each time three spaces are woken with the admin API's ``POST /wake``, one per box, kept
   awake one scaled hour with no client traffic, and put to sleep with ``POST /sleep``. Counted:
   every request moto logged for each space's ``lock.json`` (its access log, from a byte offset
   taken before the wakes to one after the sleeps: PUT, GET, DELETE, HEAD by status), beside the
   routers' ``lchat_lease_operations_total`` (admin ``GET /metrics``) and their lease log events
   (acquired, renewed, released: the renewal period and how long each lease was held).
7. **kill -9 failover at the default heartbeat**, ``--default-hb-kills`` trials: the routers
   restarted with ``LCHAT_MESH_HEARTBEAT=15s``, ``DEAD_AFTER=45s`` and ``LCHAT_LEASE_TTL`` unset
   (the 2 h mesh default), no patch; the kill trials of 3. on them, polling the survivor for up to
   dead_after + 60 s, the kills spread over one heartbeat period (trial i of N kills the owner
   0.1 s + i·heartbeat/N after one of its heartbeat PUTs landed, followed in moto's access log:
   the first is the worst case, a kill right after a beat). Read per trial: the killed box's last heartbeat ``Last-Modified`` (moto, right
   after the kill and again after the failover; the later one), hence when the heartbeat rule
   allowed a takeover (floor(LM) + 1 s + dead_after); the survivor's judgement (``lease <host>:
   holder <box> is dead (last heartbeat …s ago …)``, the age it computed) and its takeover line
   with its reason; when the lease could have been taken by its TTL alone, for 15 min (the
   per-space-renewal TTL) and the 2 h default, from the lease's ``Last-Modified``. Goal (issue 18):
   served within dead_after + 2 s = 47 s of the kill.

Each failover table row is one trial; the second table shows what the survivors' routers counted
meanwhile and the reference wake. The text under it gives medians and which component cost what.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import http.client
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib
from benchlib import Processes, log

HERE = os.path.abspath(__file__)
DOMAIN = "mesh.test"
PREFIX = "mesh-bench"
TOKEN = "mesh-bench-token-" + "x" * 24
LOG_ENV = "BENCH_MESH_LOG"  # the child router's JSON event file
PATCH_ENV = "BENCH_PEER_DIAL_RETRY"  # the child router's PEER_DIAL_RETRY, when set
DEFAULT_HEARTBEAT = 15.0  # LCHAT_MESH_HEARTBEAT's default
DEFAULT_DEAD_AFTER = 45.0  # LCHAT_MESH_DEAD_AFTER's default
DEFAULT_TTL = 900.0  # LCHAT_LEASE_TTL's default off a mesh (every box's before issue 18)
MESH_TTL = 7200.0  # LCHAT_LEASE_TTL's default on a mesh box (lchat.config.MESH_LEASE_TTL)
KILL_GOAL_SLACK = 2.0  # issue 18: hard-kill failover <= dead_after + 2 s
KILL_PHASE_OFFSET = 0.1  # default-heartbeat kill i of N: this + i/N heartbeats after a beat
LEASE_GOAL = 3.0  # issue 18: <= 3 lease requests per awake space-hour
SECTIONS = (
    "forwarding",
    "graceful",
    "kills",
    "membership",
    "lease-requests",
    "default-graceful",
    "patched",
    "default-kills",
)
EVENT_FIELDS = (
    "host",
    "url",
    "key",
    "owner",
    "reason",
    "timings",
    "total",
    "why",
    "generation",
    "n",
    "pid",
    "ago",
    "due",
    "previous",
    "age",
    "dead_after",
    "epoch",
)
# Event fields kept under another name: Box.events() sets "box" to the box that logged it.
RENAMED_FIELDS = {"box": "holder_box"}
METRIC_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------- the child router's log


def router_log_observer() -> Any:
    """twistd ``--logger`` factory (in the router process): each event as a JSON line in
    ``$BENCH_MESH_LOG`` and as a text line, with milliseconds, on the process's stdout."""
    from twisted.logger import ILogObserver, formatEvent
    from zope.interface import implementer

    @implementer(ILogObserver)
    class Observer:
        def __init__(self) -> None:
            self.json = open(os.environ[LOG_ENV], "a", buffering=1)
            # fd 1 itself: twistd points sys.stdout at the log system after this returns.
            self.text = os.fdopen(os.dup(1), "w", buffering=1)

        def __call__(self, event: dict[str, Any]) -> None:
            try:
                text = formatEvent(event)
                failure = event.get("log_failure")
                if failure is not None:
                    text += "\n" + failure.getTraceback()
                t = float(event.get("log_time") or time.time())
                stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
                self.text.write(f"{stamp} [{event.get('log_namespace', '-')}] {text}\n")
                record: dict[str, Any] = {
                    "t": t,
                    "fmt": event.get("log_format") or "",
                    "text": text,
                }
                for k in EVENT_FIELDS:
                    if k in event:
                        record[k] = event[k]
                for k, as_ in RENAMED_FIELDS.items():
                    if k in event:
                        record[as_] = event[k]
                self.json.write(json.dumps(record, default=str) + "\n")
            except Exception:
                pass

    return Observer()


def child_router(argv: list[str]) -> None:
    """``twistd`` in this process; ``$BENCH_PEER_DIAL_RETRY`` replaces lchat/proxy/upstream.py's
    ``PEER_DIAL_RETRY`` in this process only (lchat's files are not touched)."""
    from twisted.scripts.twistd import run

    # The router's reactor first: nothing imported below may install twistd's default.
    benchlib.install_router_reactor()
    retry = os.environ.get(PATCH_ENV)
    if retry is not None:
        from lchat.proxy import upstream

        upstream.PEER_DIAL_RETRY = float(retry)  # type: ignore[attr-defined]
    sys.argv = ["twistd", *argv]
    run()


# ---------------------------------------------------------------- small clients


def admin(sock: Path, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
    return benchlib.admin(sock, method, path, timeout)


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m is None:
            continue
        labels = frozenset(LABEL.findall(m.group(2) or ""))
        with contextlib.suppress(ValueError):
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= ls)


def by_label(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, label: str
) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in m.items():
        if n == name:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


class HTTPS:
    """An HTTPS client for one space on one box: SNI and Host = the space, verified with the CA,
    connected to the box's address. Kept alive unless ``fresh``."""

    def __init__(self, address: str, port: int, host: str, ca: str, timeout: float = 20.0) -> None:
        self.address, self.port, self.host, self.timeout = address, port, host, timeout
        self.context = ssl.create_default_context(cafile=ca)
        self.conn: http.client.HTTPSConnection | None = None
        self.reconnects = 0
        self.headers: dict[str, str] = {}

    def _connect(self) -> http.client.HTTPSConnection:
        raw = socket.create_connection((self.address, self.port), timeout=self.timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tls = self.context.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout)
        conn.sock = tls
        return conn

    def request(
        self, method: str, path: str, body: bytes = b"", fresh: bool = False
    ) -> tuple[int, bytes]:
        """One request; on a kept-alive connection the server closed meanwhile, once more on a
        new one (nothing was answered). ``self.headers``: the answer's headers, lowercased."""
        for attempt in (0, 1):
            reused = self.conn is not None and not fresh
            if not reused:
                self.close()
                self.conn = self._connect()
            assert self.conn is not None
            headers = {"Host": self.host}
            if body:
                headers["Content-Type"] = "application/json"
            try:
                self.conn.request(method, path, body=body or None, headers=headers)
                resp = self.conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt or not reused:
                    raise
                self.reconnects += 1
                continue
            except (OSError, http.client.HTTPException):
                self.close()
                raise
            self.headers = {k.lower(): v for k, v in resp.getheaders()}
            if resp.will_close or fresh:
                self.close()
            return resp.status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None


def one_shot(
    address: str, port: int, host: str, ca: str, method: str = "GET", path: str = "/api/version"
) -> tuple[int, bytes]:
    c = HTTPS(address, port, host, ca)
    try:
        return c.request(method, path, fresh=True)
    finally:
        c.close()


# ---------------------------------------------------------------- boxes


class Box:
    """One router: its directories, its registry, and each process it has been (one per start)."""

    def __init__(self, tmp: Path, index: int, procs: Processes) -> None:
        self.name = f"box{index}"
        self.address = f"127.0.0.{index + 2}"
        self.procs = procs
        self.dir = tmp / self.name
        self.data, self.run = self.dir / "data", self.dir / "run"
        self.acme = self.data / "acme"
        self.acme.mkdir(parents=True, mode=0o700)
        self.run.mkdir(parents=True)
        self.env_file = self.dir / "router.env"
        self.sock = self.run / "router.sock"
        self.port = 0
        self.gen = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.exited_at: float | None = None
        self.events_files: list[Path] = []
        self.space_pids: set[int] = set()

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.port}"

    def add_space(self, host: str) -> None:
        """A hibernating row and its env file, as route replication would leave them."""
        from lchat import hosts
        from lchat.registry import Registry, Route

        env_file = hosts.env_path(str(self.data), host)
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"LCHAT_ADMIN_TOKEN=" + secrets.token_hex(16).encode() + b"\n")
        os.close(fd)
        registry = Registry(str(self.data / "registry.db"), time.time)
        registry.migrate()
        registry.insert(
            Route(
                host=host,
                kind="instance",
                socket=hosts.socket_path(str(self.run), host),
                status="ready",
                hibernate=True,
            )
        )

    def start(self, settings: dict[str, str], env: dict[str, str], port: int) -> None:
        self.gen += 1
        self.port = port
        self.exited_at = None
        lines = {
            "LCHAT_DATA_DIR": str(self.data),
            "LCHAT_RUN_DIR": str(self.run),
            "LCHAT_HTTP_ADDR": "off",
            "LCHAT_HTTPS_ADDR": f"{self.address}:{port}",
            "LCHAT_UNITS": "builtin",
            # One process per box, as the figures' history (the default is one per core).
            "LCHAT_WORKERS": "1",
            "LCHAT_MESH_SELF": self.url,
            **settings,
        }
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        events = self.dir / f"events-{self.gen}.jsonl"
        self.events_files.append(events)
        self.proc = self.procs.start(
            f"{self.name}-{self.gen}",
            [
                sys.executable,
                HERE,
                "--child-router",
                "-n",
                "--pidfile=",
                "--logger=__main__.router_log_observer",
                "lchat",
                "--env-file",
                str(self.env_file),
            ],
            env={**env, LOG_ENV: str(events)},
        )
        proc = self.proc

        def watch() -> None:
            proc.wait()
            if self.proc is proc:
                self.exited_at = time.time()

        threading.Thread(target=watch, daemon=True).start()

    def signal(self, signum: int) -> float:
        """Send ``signum`` to the router process itself (not its group); the instant it was sent."""
        assert self.proc is not None
        t = time.time()
        os.kill(self.proc.pid, signum)
        return t

    def wait_exit(self, timeout: float = 60.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not exit within {timeout:g}s: SIGKILL")
            proc.kill()
            code = proc.wait()
        # Done with: the process set's cleanup must not signal a reused pid.
        self.procs.started = [(n, p) for n, p in self.procs.started if p is not proc]
        deadline = time.time() + 2
        while self.exited_at is None and time.time() < deadline:
            time.sleep(0.01)
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        return self.procs.tail(f"{self.name}-{self.gen}", 30)

    def status(self) -> dict[str, Any]:
        code, body = admin(self.sock, "GET", "/status", timeout=5)
        if code != 200:
            raise RuntimeError(f"{self.name} /status: {code}")
        result: dict[str, Any] = json.loads(body)
        for entry in result.get("hosts", {}).values():
            pid = (entry.get("activator") or {}).get("pid")
            if isinstance(pid, int):
                self.space_pids.add(pid)
        return result

    def live(self) -> int:
        return len(self.view())

    def view(self) -> set[str]:
        """The member URLs in this box's view of the mesh (empty if it does not answer)."""
        try:
            members = self.status().get("mesh", {}).get("members", [])
        except (OSError, ValueError, RuntimeError):
            return set()
        return {m["url"] for m in members}

    def awake(self) -> list[str]:
        try:
            hosts_ = self.status().get("hosts", {})
        except (OSError, ValueError, RuntimeError):
            return []
        return [h for h, e in hosts_.items() if (e.get("activator") or {}).get("state") == "awake"]

    def space_pid(self, host: str) -> int | None:
        entry = self.status().get("hosts", {}).get(host, {})
        pid = (entry.get("activator") or {}).get("pid")
        return pid if isinstance(pid, int) else None

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        code, body = admin(self.sock, "GET", "/metrics", timeout=10)
        if code != 200:
            raise RuntimeError(f"{self.name} /metrics: {code}")
        return parse_metrics(body.decode())

    def sleep_all(self) -> int:
        n = 0
        for host in self.awake():
            code, body = admin(self.sock, "POST", f"/sleep?host={host}", timeout=60)
            if code != 200:
                raise RuntimeError(f"{self.name} sleep {host}: {code} {body!r}")
            n += 1
        return n

    def events(self, since: float, until: float = math.inf) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in self.events_files:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if since <= e.get("t", 0) <= until:
                    e["box"] = self.name
                    out.append(e)
        out.sort(key=lambda e: e["t"])
        return out


def first(events: Sequence[dict[str, Any]], fmt: str, **match: Any) -> dict[str, Any] | None:
    """The first event whose format starts with ``fmt`` and whose fields equal ``match``."""
    for e in events:
        if e["fmt"].startswith(fmt) and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def count(events: Sequence[dict[str, Any]], fmt: str, **match: Any) -> int:
    return sum(
        1
        for e in events
        if e["fmt"].startswith(fmt) and all(e.get(k) == v for k, v in match.items())
    )


# The router's log lines the timelines are read from (their formats, from lchat/).
HB_DELETED = "mesh: heartbeat {key} deleted"
MEMBER_GONE = "mesh: member gone {url}"
DRAINING = "activator: draining {n} spaces"
SLEEPING = "activator: {host} sleeping ("
NEXT_DUE = "activator: {host} next due"
RELEASED = "lease {host}: released"
ASLEEP = "activator: {host} asleep ("
LEASE_HELD = "activator: {host} not woken: lease held"
ACQUIRED = "activator: {host} waking (lease acquired)"
TAKEN_OVER = "lease {host}: taken over from"
AWAKE = "activator: {host} awake ("
PEER_UNREACHABLE = "peer {peer} unreachable for {host}"  # since ee59ef9
# Issue 18 (lchat/mesh/fence.py, lchat/lease.py): a taker's judgement of the holder's box.
JUDGED_DEAD = "lease {host}: holder {box} is dead"  # "(no heartbeat)" or "(last heartbeat …)"
JUDGED_RESTARTED = "lease {host}: holder {box} restarted"  # before issue 28 (no such reason now)
LEASE_ACQUIRED = "lease {host}: acquired"
LEASE_RENEWED = "lease {host}: renewed"  # debug level: the bench's observer keeps every level


# ---------------------------------------------------------------- the poller


class Poller:
    """From ``t0``, one GET every ``interval`` to ``box``, not waiting for the earlier ones, until
    one answers 200 with ``expect`` in its body (plus ``linger``) or until ``deadline`` seconds.
    Each worker thread keeps its own connection alive (as a browser would; a request that hangs
    holds its thread and connection, the next one goes out on another); ``fresh``: a new
    connection per request. Every request's (sent, done, status, served) is kept."""

    def __init__(
        self,
        box: Box,
        host: str,
        ca: str,
        expect: bytes,
        interval: float,
        deadline: float,
        path: str = "/api/rooms/r/messages",
        fresh: bool = False,
    ) -> None:
        self.address, self.port = box.address, box.port
        self.fresh = fresh
        self.local = threading.local()
        self.clients: list[HTTPS] = []
        self.host, self.ca, self.expect, self.path = host, ca, expect, path
        self.interval, self.deadline = interval, deadline
        self.lock = threading.Lock()
        self.results: list[dict[str, Any]] = []
        self.ok_times: list[float] = []
        self.after = 0.0  # answers served before this (the old owner's) are not the failover
        self.pool = ThreadPoolExecutor(max_workers=256)
        self.futures: list[Future[None]] = []
        self.t0 = 0.0
        self.last_submit = 0.0

    def _client(self) -> HTTPS:
        client: HTTPS | None = getattr(self.local, "client", None)
        if client is None:
            client = HTTPS(self.address, self.port, self.host, self.ca)
            self.local.client = client
            with self.lock:
                self.clients.append(client)
        return client

    def prewarm(self, n: int) -> None:
        """``n`` worker threads, each with its connection open and one request answered (a
        ``GET /api/version``, before the failover): clients that were there all along."""
        barrier = threading.Barrier(n + 1)

        def warm() -> None:
            self._client().request("GET", "/api/version")
            barrier.wait(30)

        futures = [self.pool.submit(warm) for _ in range(n)]
        barrier.wait(30)
        for f in futures:
            f.result(30)

    def run(self, t0: float, moved: Callable[[], bool], linger: float = 0.25) -> None:
        """Poll until a served answer arrives once ``moved()`` (checked every 50 ms in a thread:
        the space is awake on a survivor) has said yes: an answer the stopping owner still gave
        is not a failover."""
        self.t0 = t0
        ready: list[float] = []
        stop = threading.Event()

        def check() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    if moved():
                        ready.append(time.time())
                        return
                stop.wait(0.05)

        checker = threading.Thread(target=check, daemon=True)
        checker.start()
        k = 0
        while True:
            now = time.time()
            if ready:
                with self.lock:
                    oks = [d for d in self.ok_times if d >= ready[0] - 0.2]
                if oks and now >= max(min(oks), ready[0]) + linger:
                    break
            if now >= t0 + self.deadline:
                break
            at = t0 + k * self.interval
            if now < at:
                time.sleep(min(at - now, 0.01))
                continue
            self.futures.append(self.pool.submit(self._one))
            self.last_submit = now
            k += 1
        stop.set()

    def _one(self) -> None:
        sent = time.time()
        status: int | None = None
        body = b""
        error = ""
        client = self._client()
        retry_after = None
        try:
            status, body = client.request("GET", self.path, fresh=self.fresh)
            if status == 503:
                retry_after = client.headers.get("retry-after")
        except Exception as e:
            error = f"{type(e).__name__}"
        done = time.time()
        served = status == 200 and self.expect in body
        with self.lock:
            self.results.append(
                {
                    "sent": sent,
                    "done": done,
                    "status": status,
                    "served": served,
                    "error": error,
                    "retry_after": retry_after,
                }
            )
            if served:
                self.ok_times.append(done)

    def finish(self, timeout: float) -> int:
        """Wait for outstanding requests (at most ``timeout`` s); how many are still out."""
        _, pending = wait_futures(self.futures, timeout=max(timeout, 0))
        self.pool.shutdown(wait=False)
        with self.lock:
            for client in self.clients:
                client.close()
        return len(pending)

    def summary(self) -> dict[str, Any]:
        t0 = self.t0
        with self.lock:
            rs = list(self.results)
        early = [r for r in rs if r["served"] and r["done"] < self.after]
        served = [r for r in rs if r["served"] and r["done"] >= self.after]
        first_done = min((r["done"] for r in served), default=math.nan)
        first_sent = min((r["sent"] for r in served), default=math.nan)
        statuses: dict[str, int] = {}
        for r in rs:
            key = str(r["status"]) if r["status"] is not None else (r["error"] or "error")
            if r["status"] == 200 and not r["served"]:
                key = "200 without the data"
            statuses[key] = statuses.get(key, 0) + 1
        failed = [r for r in rs if not r["served"]]
        waits = [r["done"] - r["sent"] for r in failed]
        fail502 = [r["done"] - r["sent"] for r in failed if r["status"] == 502]
        retry_after = [float(r["retry_after"]) for r in rs if r.get("retry_after")]
        return {
            "serve": first_done - t0,
            "first_sent": first_sent - t0,
            "sent": len(self.futures),
            "answered": len(rs),
            "statuses": statuses,
            "max_wait": max(waits, default=0.0),
            "fail502": fail502,
            "served_waits": [r["done"] - r["sent"] for r in served],
            "retry_after": max(retry_after, default=math.nan),
            "last_failed_sent": max((r["sent"] - t0 for r in failed), default=math.nan),
            "pending": sum(1 for f in self.futures if not f.done()),
            "old_owner_served": len(early),
        }


# ---------------------------------------------------------------- statistics


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else math.nan


def ms(seconds: float | None, digits: int = 0) -> str:
    if seconds is None or seconds != seconds:
        return "-"
    return f"{seconds * 1000:.{digits}f} ms"


def sec(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "-"
    return f"{seconds:.2f} s"


def med(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None and x == x]
    return statistics.median(vals) if vals else math.nan


def mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def rel(e: dict[str, Any] | None, t0: float) -> float | None:
    return None if e is None else e["t"] - t0


# ---------------------------------------------------------------- the mesh


class Mesh:
    def __init__(self, tmp: Path, procs: Processes, args: argparse.Namespace) -> None:
        from lchat.certfiles import wildcard_cert_path
        from lchat.cli.dev_cert import make_dev_certs
        from tests.s3servers import S3Server
        from tests.test_mesh import ip_default_cert

        self.tmp, self.procs, self.args = tmp, procs, args
        certs = tmp / "certs"
        ca, _, _ = make_dev_certs(str(certs), ["*." + DOMAIN])
        self.ca = ca
        wildcard = wildcard_cert_path(str(certs), DOMAIN)
        log("starting moto")
        self.server = S3Server("moto")
        self.server.start_sync()
        self.bucket = self.server.new_bucket_sync()
        self.s3 = self.server.client()
        creds = self.server.credentials
        self.settings = {
            "LCHAT_SPACE_COMMAND": f"env PYTHONPATH={benchlib.ROOT} {sys.executable} -m lchat.space",
            "LCHAT_HIBERNATE_BUCKET": self.bucket,
            "LCHAT_HIBERNATE_ENDPOINT": self.server.endpoint,
            "LCHAT_HIBERNATE_REGION": self.server.region,
            "LCHAT_HIBERNATE_PREFIX": PREFIX,
            "LCHAT_HIBERNATE_IDLE": "300s",
            "LCHAT_LEASE_TTL": f"{args.lease_ttl:g}s",
            "LCHAT_MESH_DOMAINS": DOMAIN,
            "LCHAT_MESH_TOKEN": TOKEN,
            "LCHAT_MESH_HEARTBEAT": f"{args.heartbeat * 1000:g}ms",
            "LCHAT_MESH_DEAD_AFTER": f"{args.dead_after * 1000:g}ms",
            "LCHAT_MESH_CA_FILE": ca,
        }
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("LCHAT_", "AWS_")) and k != "PYTHONSTARTUP"
        }
        self.env = {
            **base,
            "PYTHONPATH": str(benchlib.ROOT),
            "AWS_ACCESS_KEY_ID": creds.access_key,
            "AWS_SECRET_ACCESS_KEY": creds.secret_key,
        }
        self.hb, self.dead = args.heartbeat, args.dead_after
        self.ttl: float = args.lease_ttl  # the lease TTL of the boxes started from now on
        self.boxes = [Box(tmp, i, procs) for i in range(3)]
        for box in self.boxes:
            dest = box.acme / os.path.basename(wildcard)
            shutil.copy(wildcard, dest)
            os.chmod(dest, 0o600)
            # The certificate a box serves without SNI: its peers' beats (POST /api/mesh/beat,
            # issue 28) call https://<its address>:<port>. Without it no beat is answered, so no
            # peer ever has the permission to judge a killed box dead.
            ip_default_cert(str(certs), str(box.acme), box.address)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.destroy_sync()

    def set_heartbeat(self, heartbeat: float, dead_after: float) -> None:
        """For the boxes started from now on."""
        self.hb, self.dead = heartbeat, dead_after
        self.settings["LCHAT_MESH_HEARTBEAT"] = f"{heartbeat * 1000:g}ms"
        self.settings["LCHAT_MESH_DEAD_AFTER"] = f"{dead_after * 1000:g}ms"

    def set_lease_ttl(self, ttl: float | None) -> None:
        """For the boxes started from now on; None: ``LCHAT_LEASE_TTL`` unset (a mesh box's
        default, 2 h)."""
        if ttl is None:
            self.settings.pop("LCHAT_LEASE_TTL", None)
            self.ttl = mesh_default_ttl()
        else:
            self.settings["LCHAT_LEASE_TTL"] = f"{ttl * 1000:g}ms"
            self.ttl = ttl

    def restart(
        self, heartbeat: float, dead_after: float, ttl: float | None, patch: float | None = None
    ) -> float:
        """Stop every box (SIGTERM: they drain), forget their heartbeats, start all three again
        with these settings (``patch``: ``PEER_DIAL_RETRY`` in the routers); seconds until all
        three saw each other."""
        if any(b.proc is not None for b in self.boxes):
            self.stop_all()
            self.kill_orphans()
            self.clear_members()
        self.set_heartbeat(heartbeat, dead_after)
        self.set_lease_ttl(ttl)
        if patch is None:
            self.env.pop(PATCH_ENV, None)
        else:
            self.env[PATCH_ENV] = f"{patch:g}"
        t = time.time()
        self.start_all()
        return time.time() - t

    @property
    def server_log(self) -> Path:
        """moto's access log (tests/s3servers.py points its stdout and stderr there): one line
        per request, ``"PUT /<bucket>/<key> HTTP/1.1" 200``."""
        return Path(self.server.dir) / "server.log"

    def wait_beat(self, url: str, timeout: float) -> float:
        """Block until moto logs the next heartbeat PUT of the member ``url`` (its access log,
        followed every 5 ms: the line is written once the answer is sent); the instant it was
        seen, within ~10 ms of the heartbeat's ``Last-Modified``."""
        path = "/" + self.bucket + "/" + self.member_key(url)
        deadline = time.time() + timeout
        with self.server_log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            pending = ""
            while time.time() < deadline:
                chunk = f.read()
                if not chunk:
                    time.sleep(0.005)
                    continue
                seen = time.time()
                pending += chunk.decode(errors="replace")
                lines = pending.split("\n")
                pending = lines.pop()
                for line in lines:
                    m = ACCESS_LINE.search(ANSI.sub("", line))
                    if m and m.group(1) == "PUT" and m.group(2) == path and m.group(3) == "200":
                        return seen
        raise RuntimeError(f"no heartbeat of {url} in moto's log for {timeout:g}s")

    def add_spaces(self, hosts_: Sequence[str]) -> None:
        for box in self.boxes:
            for host in hosts_:
                box.add_space(host)

    def start(self, box: Box) -> None:
        from tests.s3servers import free_ports

        (port,) = free_ports(1)
        box.start(self.settings, self.env, port)

    def start_all(self) -> None:
        for box in self.boxes:
            self.start(box)
        for box in self.boxes:
            self.wait_up(box)
        self.converge(3 * self.hb + 30)

    def wait_up(self, box: Box, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not box.alive():
                raise RuntimeError(f"{box.name} exited:\n{box.tail()}")
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                box.status()
                return
            time.sleep(0.05)
        raise RuntimeError(f"{box.name} did not answer in {timeout:g}s:\n{box.tail()}")

    def converge(self, timeout: float = 30.0) -> float:
        """Wait until every running box sees exactly the running boxes (no member that has
        gone, none missing); seconds it took."""
        from lchat.mesh.placement import normalise_member_url

        t = time.time()
        running = [b for b in self.boxes if b.alive()]
        want = {normalise_member_url(b.url) for b in running}
        while time.time() < t + timeout:
            if all(b.view() == want for b in running):
                return time.time() - t
            time.sleep(0.1)
        views = {b.name: sorted(b.view()) for b in running}
        raise RuntimeError(f"membership did not converge in {timeout:g}s: {views}")

    def clear_members(self) -> int:
        """Delete every heartbeat object (all boxes stopped): a killed box's beat must not count
        as live for a mesh restarted with a longer dead-after."""
        prefix = f"{PREFIX}/mesh/members/"
        listed = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        keys = [o["Key"] for o in listed.get("Contents", [])]
        for key in keys:
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        return len(keys)

    def owner_of(self, host: str, timeout: float = 10.0) -> Box:
        deadline = time.time() + timeout
        while time.time() < deadline:
            on = [b for b in self.boxes if b.alive() and host in b.awake()]
            if len(on) == 1:
                return on[0]
            if len(on) > 1:
                raise RuntimeError(f"{host} awake on {[b.name for b in on]}")
            time.sleep(0.05)
        raise RuntimeError(f"{host} is awake nowhere")

    def sleep_everything(self) -> None:
        for box in self.boxes:
            if box.alive():
                box.sleep_all()

    def head(self, key: str) -> datetime.datetime | None:
        try:
            got = self.s3.head_object(Bucket=self.bucket, Key=key)
        except Exception:
            return None
        lm: datetime.datetime = got["LastModified"]
        return lm

    def lease_key(self, host: str) -> str:
        return f"{PREFIX}/{host}/lock.json"

    def member_key(self, url: str) -> str:
        name = base64.urlsafe_b64encode(url.encode()).rstrip(b"=").decode()
        return f"{PREFIX}/mesh/members/{name}"

    def stop_all(self) -> None:
        for box in self.boxes:
            if box.alive():
                box.signal(signal.SIGTERM)
        for box in self.boxes:
            if box.proc is not None:
                box.wait_exit(60)

    def kill_orphans(self) -> int:
        """Spaces whose router was SIGKILLed live on (their own session): stop them by pid."""
        n = 0
        for box in self.boxes:
            for pid in list(box.space_pids):
                if _is_our_space(pid, self.tmp):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        n += 1
                box.space_pids.discard(pid)
        return n


class OtherCPU:
    """CPU the machine spent on processes that are not this benchmark's, as a share of one core,
    between ``start()`` and ``share()``: a shared machine's noise, reported beside the numbers."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.mark = (0.0, 0.0, 0.0)

    def _ours(self) -> float:
        pids = [b.proc.pid for b in self.mesh.boxes if b.alive() and b.proc is not None]
        moto = getattr(self.mesh.server, "_proc", None)
        if moto is not None:
            pids.append(moto.pid)
        return benchlib.own_cpu_seconds() + sum(benchlib.tree_cpu(p) for p in pids)

    def start(self) -> None:
        self.mark = (time.monotonic(), benchlib.busy_cpu_seconds(), self._ours())

    def share(self) -> float:
        t, busy, ours = self.mark
        other = benchlib.busy_cpu_seconds() - busy - (self._ours() - ours)
        return max(0.0, other) / max(time.monotonic() - t, 1e-9)


def mesh_default_ttl() -> float:
    """``LCHAT_LEASE_TTL`` on a mesh box when unset (lchat/config.py), in seconds."""
    from lchat.config import MESH_LEASE_TTL, parse_duration

    return parse_duration("LCHAT_LEASE_TTL", MESH_LEASE_TTL)


def _is_our_space(pid: int, tmp: Path) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return b"lchat.space" in cmd and str(tmp).encode() in environ


# ---------------------------------------------------------------- 1. forwarding


def forwarding(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    host = f"fwd.{DOMAIN}"
    entry = mesh.boxes[0]
    code, body = one_shot(entry.address, entry.port, host, mesh.ca)
    if code != 200:
        raise RuntimeError(f"GET {host} via {entry.name}: {code} {body!r}")
    owner = mesh.owner_of(host)
    other = next(b for b in mesh.boxes if b is not owner)
    log(f"forwarding: {host} awake on {owner.name}; forwarded through {other.name}")
    direct = HTTPS(owner.address, owner.port, host, mesh.ca)
    fwd = HTTPS(other.address, other.port, host, mesh.ca)
    for _ in range(200):  # warm-up: connections, the peer pool, the holder cache
        for c in (direct, fwd):
            code, body = c.request("GET", "/api/version")
            assert code == 200, (code, body)
    m0_other, m0_owner = other.metrics(), owner.metrics()
    other_cpu = OtherCPU(mesh)
    other_cpu.start()
    assert other.proc is not None and owner.proc is not None
    cpu0 = benchlib.cpu_seconds([other.proc.pid]), benchlib.cpu_seconds([owner.proc.pid])
    lat: dict[str, list[float]] = {"direct": [], "forwarded": []}
    t_run = time.perf_counter()
    for _ in range(args.requests):
        for name, c in (("direct", direct), ("forwarded", fwd)):
            t = time.perf_counter()
            code, _ = c.request("GET", "/api/version")
            lat[name].append(time.perf_counter() - t)
            if code != 200:
                raise RuntimeError(f"{name}: {code}")
    t_run = time.perf_counter() - t_run
    noise = other_cpu.share()
    cpu1 = benchlib.cpu_seconds([other.proc.pid]), benchlib.cpu_seconds([owner.proc.pid])
    m1_other, m1_owner = other.metrics(), owner.metrics()
    reconnects = direct.reconnects + fwd.reconnects
    direct.close()
    fwd.close()
    fresh: dict[str, list[float]] = {"direct": [], "forwarded": []}
    for _ in range(args.fresh):
        for name, b in (("direct", owner), ("forwarded", other)):
            t = time.perf_counter()
            code, _ = one_shot(b.address, b.port, host, mesh.ca)
            fresh[name].append(time.perf_counter() - t)
            if code != 200:
                raise RuntimeError(f"fresh {name}: {code}")

    def delta(m1: Any, m0: Any, name: str, **labels: str) -> float:
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    s3_other = {
        op: delta(m1_other, m0_other, "lchat_s3_requests_total", operation=op)
        for op in ("GetObject", "PutObject", "ListObjectsV2", "HeadBucket")
    }
    get_n = delta(m1_other, m0_other, "lchat_s3_request_seconds_count", operation="GetObject")
    get_s = delta(m1_other, m0_other, "lchat_s3_request_seconds_sum", operation="GetObject")
    outcomes = {
        k: v - by_label(m0_other, "lchat_mesh_forwards_total", "outcome").get(k, 0.0)
        for k, v in by_label(m1_other, "lchat_mesh_forwards_total", "outcome").items()
    }
    owner_marked = delta(m1_owner, m0_owner, "lchat_mesh_forwards_total", outcome="local_forwarded")
    admin(owner.sock, "POST", f"/sleep?host={host}", timeout=60)
    return {
        "owner": owner.name,
        "other": other.name,
        "lat": lat,
        "fresh": fresh,
        "run_seconds": t_run,
        "cpu_other": cpu1[0] - cpu0[0],
        "cpu_owner": cpu1[1] - cpu0[1],
        "s3_other": s3_other,
        "get_mean": get_s / get_n if get_n else math.nan,
        "outcomes": {k: v for k, v in outcomes.items() if v},
        "owner_marked": owner_marked,
        "reconnects": reconnects,
        "other_cpu": noise,
    }


# ---------------------------------------------------------------- 2./3. failover


def post_message(mesh: Mesh, via: Box, host: str, text: str) -> None:
    c = HTTPS(via.address, via.port, host, mesh.ca, timeout=60)
    try:
        body = json.dumps({"body": text}).encode()
        code, answer = c.request("POST", "/api/rooms/r/messages", body, fresh=True)
    finally:
        c.close()
    if code != 201:
        raise RuntimeError(f"POST {host} via {via.name}: {code} {answer!r}")


def failover_trial(
    mesh: Mesh,
    args: argparse.Namespace,
    kind: str,
    i: int,
    prefix: str = "",
    deadline: float | None = None,
    beat_phase: float | None = None,
) -> dict[str, Any]:
    """One failover: ``kind`` "graceful" (SIGTERM) or "kill" (SIGKILL) to the owner of a space
    woken by a post; ``deadline``: how long the poller tries (default: lease TTL + dead_after +
    20 s for a kill, 30 s for a graceful stop); ``beat_phase``: send the signal this long after
    one of the owner's heartbeats landed (moto's log), rather than whenever the trial is ready."""
    host = f"{prefix or kind[0]}{i}.{DOMAIN}"
    if deadline is None:
        deadline = mesh.ttl + mesh.dead + 20 if kind == "kill" else 30.0
    mesh.sleep_everything()
    other_cpu = OtherCPU(mesh)
    other_cpu.start()
    via = mesh.boxes[i % 3]
    text = f"{kind} trial {i} {secrets.token_hex(4)}"
    post_message(mesh, via, host, text)
    owner = mesh.owner_of(host)
    survivors = [b for b in mesh.boxes if b is not owner]
    target = survivors[i % 2]  # the box the poller asks
    other = survivors[1 - i % 2]
    space_pid = owner.space_pid(host)
    time.sleep(1.5 if kind == "kill" else 1.0)  # kill: the stream class ships within ~1 s
    owner_url = owner.url
    poller = Poller(
        target,
        host,
        mesh.ca,
        text.encode(),
        args.poll,
        deadline,
    )
    poller.prewarm(args.clients)
    m0 = {b.name: b.metrics() for b in survivors}
    beat_seen = None
    if beat_phase is not None:
        beat_seen = mesh.wait_beat(owner_url, mesh.hb + 10)
        time.sleep(max(0.0, beat_seen + beat_phase - time.time()))
    t0 = owner.signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
    lease_lm = member_lm = None
    if kind == "kill":
        lease_lm = mesh.head(mesh.lease_key(host))
        member_lm = mesh.head(mesh.member_key(owner_url))
    poller.run(t0, lambda: any(host in b.awake() for b in survivors))
    m1 = {b.name: b.metrics() for b in survivors}
    if kind == "kill":
        # A beat PUT the owner sent just before the kill may have landed after the first read.
        later = mesh.head(mesh.member_key(owner_url))
        if later is not None and (member_lm is None or later > member_lm):
            member_lm = later
    noise = other_cpu.share()
    code = owner.wait_exit(60)
    t_exit = owner.exited_at
    if kind == "kill" and space_pid is not None and _is_our_space(space_pid, mesh.tmp):
        with contextlib.suppress(ProcessLookupError):
            os.kill(space_pid, signal.SIGKILL)
    time.sleep(0.2)  # the last log lines
    ev_owner = owner.events(t0 - 0.5)
    renewed = [
        e["t"]
        for e in owner.events(t0 - 2 * mesh.ttl, t0)
        if e["fmt"].startswith(("lease {host}: renewed", "lease {host}: acquired"))
        and e.get("host") == host
    ]
    ev_target, ev_other = target.events(t0 - 0.5), other.events(t0 - 0.5)
    ev_surv = sorted(ev_target + ev_other, key=lambda e: e["t"])
    woke = first(ev_surv, ACQUIRED, host=host)
    awake = first(ev_surv, AWAKE, host=host)
    if awake is not None:
        poller.after = awake["t"]
    summary = poller.summary()
    res: dict[str, Any] = {
        "kind": kind,
        "host": host,
        "owner": owner.name,
        "target": target.name,
        "other": other.name,
        "exit_code": code,
        "exit": None if t_exit is None else t_exit - t0,
        "deleted": rel(first(ev_owner, HB_DELETED), t0),
        "draining": rel(first(ev_owner, DRAINING), t0),
        "sleeping": rel(first(ev_owner, SLEEPING, host=host), t0),
        "next_due": rel(first(ev_owner, NEXT_DUE, host=host), t0),
        "released": rel(first(ev_owner, RELEASED, host=host), t0),
        "asleep": rel(first(ev_owner, ASLEEP, host=host), t0),
        "gone_target": rel(first(ev_target, MEMBER_GONE, url=owner_url), t0),
        "gone_other": rel(first(ev_other, MEMBER_GONE, url=owner_url), t0),
        "fallback_target": rel(first(ev_target, PEER_UNREACHABLE, host=host), t0),
        "fallback_other": rel(first(ev_other, PEER_UNREACHABLE, host=host), t0),
        "heartbeat": mesh.hb,
        "dead_after": mesh.dead,
        "beat_phase": beat_phase,
        "beat_seen": None if beat_seen is None else t0 - beat_seen,
        "other_cpu": noise,
        "held": count(ev_surv, LEASE_HELD, host=host),
        "acquired": rel(woke, t0),
        "taken_over": rel(first(ev_surv, TAKEN_OVER, host=host), t0),
        "woke_on": None if woke is None else woke["box"],
        "awake": rel(awake, t0),
        "timings": (awake or {}).get("timings") or {},
        **summary,
        "target_metrics": _trial_metrics(m0[target.name], m1[target.name]),
        "other_metrics": _trial_metrics(m0[other.name], m1[other.name]),
    }
    if kind == "kill":
        ttl = mesh.ttl
        res["ttl"] = ttl
        if lease_lm is not None:
            # floor(LM) + 1 s: no earlier than the write (stores truncate Last-Modified).
            written = lease_lm.replace(microsecond=0).timestamp() + 1
            res["lease_written"] = written - t0
            res["lease_expiry"] = written + math.ceil(ttl) - t0
        if renewed:
            res["lease_age"] = t0 - renewed[-1]
        if member_lm is not None:
            res["member_dead"] = member_lm.timestamp() + mesh.dead - t0
            beat = member_lm.replace(microsecond=0).timestamp()
            res["beat_lm"] = beat - t0
            # lchat/mesh/fence.py judged_dead: the bucket's clock at floor(LM) + 1 s + dead_after.
            res["hb_takeable"] = beat + 1 + mesh.dead - t0
        taken = first(ev_surv, TAKEN_OVER, host=host)
        res["takeover_reason"] = None if taken is None else taken.get("reason")
        judged = None
        if taken is not None:
            judgements = [
                e
                for e in ev_surv
                if e["box"] == taken["box"]
                and e["t"] <= taken["t"]
                and e.get("host") == host
                and e["fmt"].startswith((JUDGED_DEAD, JUDGED_RESTARTED))
            ]
            judged = judgements[-1] if judgements else None
        res["judged"] = rel(judged, t0)
        res["judged_age"] = None if judged is None else judged.get("age")
        res["judged_text"] = "" if judged is None else judged["text"]
        res["judgements"] = count(ev_surv, JUDGED_DEAD, host=host) + count(
            ev_surv, JUDGED_RESTARTED, host=host
        )
    log(
        f"{kind} {i}: {owner.name} -> {res['woke_on']}, served after {sec(res['serve'])} "
        f"(survivor saw the member gone at {sec(res['gone_target'])}, re-routed at "
        f"{sec(res['fallback_target'])}, lease "
        f"{'released' if kind != 'kill' else 'taken over'} at "
        f"{sec(res['released'] if kind != 'kill' else res['taken_over'])}"
        + (
            f" ({res['takeover_reason']}; judged: {res['judged_text'] or '-'}; heartbeat rule "
            f"allowed it at {sec(res.get('hb_takeable'))})"
            if kind == "kill"
            else ""
        )
        + f"); {res['statuses']}"
    )
    mesh.start(owner)  # a new port: a new member URL
    # Requests still out (re-dialling the stopped owner) end with the dial retry: wait for
    # them, so that none lands in the reference wake or is cut by a later trial.
    poller.finish(poller.last_submit + 16.0 - time.time())
    res.update(poller.summary())
    res["reference"] = reference_wake(
        mesh, host, [b for b in survivors if b.name != res["woke_on"]]
    )
    mesh.wait_up(owner)
    mesh.converge(3 * mesh.hb + 30)
    return res


def reference_wake(mesh: Mesh, host: str, candidates: list[Box]) -> dict[str, Any]:
    """The same cold wake without a failover around it: the space put to sleep where it woke,
    then woken with the admin API's ``POST /wake`` on a survivor that has never run it."""
    if not candidates:
        return {}
    mesh.sleep_everything()
    box = candidates[0]
    t = time.time()
    code, body = admin(box.sock, "POST", f"/wake?host={host}", timeout=60)
    took = time.time() - t
    if code != 200:
        log(f"reference wake of {host} on {box.name}: {code} {body!r}")
        return {}
    time.sleep(0.1)
    awake = first(box.events(t - 0.1), AWAKE, host=host)
    admin(box.sock, "POST", f"/sleep?host={host}", timeout=60)
    return {"box": box.name, "client": took, "timings": (awake or {}).get("timings") or {}}


def _trial_metrics(m0: Any, m1: Any) -> dict[str, Any]:
    """What one survivor did between the signal and the first served answer."""

    def delta(name: str, label: str) -> dict[str, float]:
        before = by_label(m0, name, label)
        return {
            k: v - before.get(k, 0.0)
            for k, v in by_label(m1, name, label).items()
            if v - before.get(k, 0.0)
        }

    gets = metric(m1, "lchat_s3_request_seconds_count", operation="GetObject") - metric(
        m0, "lchat_s3_request_seconds_count", operation="GetObject"
    )
    get_s = metric(m1, "lchat_s3_request_seconds_sum", operation="GetObject") - metric(
        m0, "lchat_s3_request_seconds_sum", operation="GetObject"
    )
    return {
        "routing": delta("lchat_mesh_forwards_total", "outcome"),
        "unavailable": delta("lchat_activator_unavailable_total", "reason"),
        "dial_retries": metric(m1, "lchat_upstream_dial_retries_total")
        - metric(m0, "lchat_upstream_dial_retries_total"),
        "s3": delta("lchat_s3_requests_total", "operation"),
        "get_mean": get_s / gets if gets else math.nan,
    }


# ---------------------------------------------------------------- 4. membership requests


def membership_cost(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    mesh.sleep_everything()
    time.sleep(max(2.0, mesh.hb * 2))
    before = {b.name: b.metrics() for b in mesh.boxes}
    t = time.time()
    time.sleep(args.idle)
    span = time.time() - t
    after = {b.name: b.metrics() for b in mesh.boxes}
    cost_hb = mesh.hb
    per_box: dict[str, dict[str, float]] = {}
    for b in mesh.boxes:
        ops0 = by_label(before[b.name], "lchat_s3_requests_total", "operation")
        ops1 = by_label(after[b.name], "lchat_s3_requests_total", "operation")
        per_box[b.name] = {k: v - ops0.get(k, 0.0) for k, v in ops1.items() if v - ops0.get(k, 0.0)}
    return {"span": span, "per_box": per_box, "heartbeat": cost_hb}


# ---------------------------------------------------------------- 6. lease requests per space-hour

ACCESS_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _lease_tag(real_ttl: float | None) -> str:
    return "m" if real_ttl is None else f"s{real_ttl:g}"


def lease_hosts(tag: str) -> list[str]:
    return [f"l{tag}{i}.{DOMAIN}" for i in range(3)]


def lease_requests(
    mesh: Mesh, args: argparse.Namespace, real_ttl: float | None, tag: str
) -> dict[str, Any]:
    """One scaled hour (``--lease-hour`` s) awake for three spaces, one per box, with the lease
    TTL ``real_ttl`` scaled by the same factor (None: the mesh default, 2 h); what the bucket
    saw for their ``lock.json`` meanwhile. The mesh is restarted with that TTL first."""
    real = mesh_default_ttl() if real_ttl is None else real_ttl
    scale = args.lease_hour / 3600.0
    mesh.restart(args.heartbeat, args.dead_after, real * scale)
    ttl = mesh.ttl
    hosts_ = lease_hosts(tag)
    before = {b.name: b.metrics() for b in mesh.boxes}
    offset = mesh.server_log.stat().st_size
    t_start = time.time()
    spans: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    def hold(box: Box, host: str) -> None:
        t = time.time()
        code, body = admin(box.sock, "POST", f"/wake?host={host}", timeout=60)
        woke = time.time()
        if code != 200:
            errors.append(f"wake {host} on {box.name}: {code} {body!r}")
            return
        time.sleep(max(0.0, woke + args.lease_hour - time.time()))
        asleep_from = time.time()
        code, body = admin(box.sock, "POST", f"/sleep?host={host}", timeout=60)
        if code != 200:
            errors.append(f"sleep {host} on {box.name}: {code} {body!r}")
        spans[host] = {
            "box": box.name,
            "wake": woke - t,
            "awake": asleep_from - woke,
            "sleep": time.time() - asleep_from,
        }

    threads = [
        threading.Thread(target=hold, args=(box, host), daemon=True)
        for box, host in zip(mesh.boxes, hosts_, strict=True)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(args.lease_hour + 180)
    time.sleep(0.5)  # the last lines of moto's log and of the routers'
    after = {b.name: b.metrics() for b in mesh.boxes}
    with mesh.server_log.open("rb") as f:
        f.seek(offset)
        access = f.read().decode(errors="replace")
    if errors:
        raise RuntimeError("; ".join(errors))

    per_host: dict[str, dict[str, Any]] = {}
    for host in hosts_:
        key = "/" + mesh.lease_key(host)
        requests: dict[str, int] = {}
        for line in access.splitlines():
            m = ACCESS_LINE.search(ANSI.sub("", line))
            if m is None or not m.group(2).split("?")[0].endswith(key):
                continue
            label = f"{m.group(1)} {m.group(3)}"
            requests[label] = requests.get(label, 0) + 1
        box = next(b for b in mesh.boxes if b.name == spans[host]["box"])
        ev = [e for e in box.events(t_start) if e.get("host") == host]
        acquired = first(ev, LEASE_ACQUIRED)
        released = first(ev, RELEASED)
        renewals = [e["t"] for e in ev if e["fmt"].startswith(LEASE_RENEWED)]
        per_host[host] = {
            **spans[host],
            "requests": requests,
            "total": sum(requests.values()),
            "held": (
                released["t"] - acquired["t"]
                if acquired is not None and released is not None
                else math.nan
            ),
            "renewals": len(renewals),
            "periods": [
                b - a
                for a, b in zip(
                    [acquired["t"] if acquired else math.nan, *renewals], renewals, strict=False
                )
            ],
        }
    ops: dict[str, float] = {}
    for b in mesh.boxes:
        m0 = by_label_pairs(before[b.name], "lchat_lease_operations_total")
        for k, v in by_label_pairs(after[b.name], "lchat_lease_operations_total").items():
            if v - m0.get(k, 0.0):
                ops[k] = ops.get(k, 0.0) + v - m0.get(k, 0.0)
    return {
        "tag": tag,
        "real_ttl": real,
        "ttl": ttl,
        "scale": scale,
        "hour": args.lease_hour,
        "heartbeat": mesh.hb,
        "hosts": per_host,
        "operations": ops,
    }


def by_label_pairs(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str
) -> dict[str, float]:
    """``lchat_lease_operations_total`` as {"operation outcome": value}."""
    out: dict[str, float] = {}
    for (n, ls), v in m.items():
        if n == name:
            d = dict(ls)
            key = f"{d.get('operation', '')} {d.get('outcome', '')}"
            out[key] = out.get(key, 0.0) + v
    return out


# ---------------------------------------------------------------- report


def _paired(lat: dict[str, list[float]]) -> float:
    return statistics.median(f - d for f, d in zip(lat["forwarded"], lat["direct"], strict=True))


def lat_row(label: str, xs: Sequence[float]) -> list[str]:
    return [
        label,
        str(len(xs)),
        ms(statistics.median(xs), 2),
        ms(pct(xs, 0.9), 2),
        ms(pct(xs, 0.99), 2),
        ms(max(xs), 1),
        ms(statistics.mean(xs), 2),
    ]


def report(
    args: argparse.Namespace,
    fwd: dict[str, Any] | None,
    graceful: list[dict[str, Any]],
    kills: list[dict[str, Any]],
    cost: dict[str, Any] | None,
    converge_s: float | None,
    slow_hb: list[dict[str, Any]],
    patched: list[dict[str, Any]],
    leases: list[dict[str, Any]],
    dkills: list[dict[str, Any]],
) -> str:
    out: list[str] = []
    hb, dead, ttl = args.heartbeat, args.dead_after, args.lease_ttl
    if converge_s is not None:
        out += [
            f"Settings: `LCHAT_MESH_HEARTBEAT={hb * 1000:g}ms`, `LCHAT_MESH_DEAD_AFTER={dead * 1000:g}ms` "
            f"(the default 1:3 ratio, 15 s : 45 s scaled down), `LCHAT_LEASE_TTL={ttl:g}s` (renewed "
            f"every {ttl / 3:.2f} s), `LCHAT_DIAL_RETRY` default (13 s; "
            + (
                f"{peer_dial_retry():g} s towards a peer, `PEER_DIAL_RETRY`"
                if peer_dial_retry() is not None
                else "towards peers too"
            )
            + "), moto on loopback, three routers on 127.0.0.2-4 sharing 2 cores with moto, the "
            f"spaces and this client (the later sections restart them with other settings, "
            f"said in each). All three saw each other {converge_s:.1f} s after starting.",
            "",
        ]
    else:
        out += [
            f"Sections run: {args.only}. Three routers on 127.0.0.2-4 and moto on loopback, "
            f"sharing 2 cores with the spaces and this client; each section says its settings.",
            "",
        ]
    if fwd is not None:
        out += _forwarding_section(fwd)

    # -- failover
    sections = [
        (graceful, "graceful", f"{len(graceful)} trials at the {hb * 1000:g} ms heartbeat"),
        (kills, "kill", f"{len(kills)} trials"),
        (slow_hb, "graceful", f"{len(slow_hb)} trials at the default 15 s heartbeat"),
        (
            patched,
            "graceful",
            f"{len(patched)} trials at the default 15 s heartbeat, the routers' "
            f"`PEER_DIAL_RETRY` patched to {args.patched_retry:g} s",
        ),
    ]
    for trials, kind, what in sections:
        if trials:
            out += [*_failover_section(trials, kind, what, args), ""]

    if leases:
        out += [*_lease_section(leases), ""]
    if dkills:
        out += [*_default_kill_section(dkills, args), ""]
    if cost is not None:
        out += _membership_section(cost, leases)

    # -- goals
    out += [
        "### Goals",
        "",
        *_forwarding_goal(fwd),
        *(
            f"- graceful failover ≤ 1 s to serving: {mark(med(serve) <= 1.0)} (median "
            f"{sec(med(serve))}, max {sec(max(serve))} over {len(serve)} trials at the "
            f"{trials[0]['heartbeat']:g} s heartbeat"
            + (
                f", `PEER_DIAL_RETRY` patched to {trials[0]['patched']:g} s"
                if trials[0].get("patched") is not None
                else ""
            )
            + "; the Go system measured ~2 s)"
            for trials in (graceful, slow_hb, patched)
            if trials
            for serve in ([t["serve"] for t in trials],)
        ),
        *(
            f"- kill -9 failover ≤ lease TTL + 1 s = {ttl + 1:g} s: "
            f"{mark(med(serve) <= ttl + 1)} (median {sec(med(serve))}, max {sec(max(serve))} "
            f"over {len(serve)} trials, dead_after {dead:g} s)"
            for serve in ([t["serve"] for t in kills],)
            if kills
        ),
        *_lease_goal(leases),
        *_default_kill_goal(dkills),
    ]
    return "\n".join(out)


def _forwarding_section(fwd: dict[str, Any]) -> list[str]:
    out: list[str] = []
    lat, fresh = fwd["lat"], fwd["fresh"]
    d50 = statistics.median(lat["forwarded"]) - statistics.median(lat["direct"])
    d99 = pct(lat["forwarded"], 0.99) - pct(lat["direct"], 0.99)
    paired = statistics.median(f - d for f, d in zip(lat["forwarded"], lat["direct"], strict=True))
    head = ["", "n", "p50", "p90", "p99", "max", "mean"]
    rows = [
        lat_row("kept-alive, direct to the owner", lat["direct"]),
        lat_row("kept-alive, via a non-owner (TLS hop)", lat["forwarded"]),
    ]
    if fresh["direct"]:
        rows += [
            lat_row("new connection each, direct", fresh["direct"]),
            lat_row("new connection each, via a non-owner", fresh["forwarded"]),
        ]
    n = len(lat["forwarded"])
    gets = fwd["s3_other"].get("GetObject", 0)
    out += [
        f"### Forwarding overhead (`GET /api/version`, one request at a time, direct and forwarded "
        f"alternating; owner {fwd['owner']}, forwarded through {fwd['other']})",
        "",
        benchlib.table(head, rows),
        "",
        f"- Forwarding adds **{ms(d50, 2)} at p50** ({ms(d99, 2)} at p99; paired median "
        f"{ms(paired, 2)}) on a kept-alive client connection"
        + (
            f"; {ms(statistics.median(fresh['forwarded']) - statistics.median(fresh['direct']), 2)} "
            f"at p50 (paired median {ms(_paired(fresh), 2)}) with a new client connection (TCP + "
            f"TLS handshake, ~40 ms of Python TLS on this machine) per request, where the noise "
            f"of the handshakes is larger than the hop"
            if fresh["direct"]
            else ""
        )
        + ".",
        f"- The forwarding box spent {fwd['cpu_other'] / n * 1e6:.0f} µs of CPU per forwarded "
        f"request (its whole process over the run: {fwd['cpu_other']:.2f} s for {n}); the owner "
        f"{fwd['cpu_owner'] / (2 * n) * 1e6:.0f} µs per request, direct or forwarded.",
        "- Routing decisions on the forwarding box: "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(fwd["outcomes"].items()))
        + f"; the owner served {fwd['owner_marked']:g} with an authentic forwarded marker. "
        f"S3 requests of the forwarding box during the {fwd['run_seconds']:.1f} s run: "
        + ", ".join(f"{k} {v:g}" for k, v in fwd["s3_other"].items() if v)
        + f" — the lease holder is read (GET lock.json) once per 2 s per forwarded host "
        f"(`holder_ttl`), so {gets:g} forwarded requests waited for an S3 GET "
        f"({ms(fwd['get_mean'], 1)} each on moto) "
        f"(≈ {gets / max(fwd['run_seconds'], 1e-9) * 3600:,.0f} GETs per busy forwarded host-hour)."
        + (f" Client reconnects: {fwd['reconnects']}." if fwd["reconnects"] else "")
        + f" Other processes on the machine used {fwd['other_cpu'] * 100:.0f}% of a core "
        f"meanwhile.",
        "",
    ]

    return out


def _forwarding_goal(fwd: dict[str, Any] | None) -> list[str]:
    if fwd is None:
        return []
    lat, fresh = fwd["lat"], fwd["fresh"]
    d50 = statistics.median(lat["forwarded"]) - statistics.median(lat["direct"])
    d_fresh = _paired(fresh) if fresh["direct"] else math.nan
    return [
        f"- forwarding adds ≤ 2 ms p50: {mark(d50 <= 0.002)} ({ms(d50, 2)} kept-alive; "
        f"{ms(d_fresh, 2)} paired median with a new connection per request)"
    ]


def _membership_section(cost: dict[str, Any], leases: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    span = cost["span"]
    hb = cost["heartbeat"]
    beats = span / hb
    rows = []
    totals = []
    for name, ops in cost["per_box"].items():
        total = sum(ops.values())
        totals.append(total)
        per_beat = total / beats
        rows.append(
            [
                name,
                ", ".join(f"{k} {v:g}" for k, v in sorted(ops.items())) or "-",
                f"{per_beat:.2f}",
                f"{per_beat * 3600 / hb:,.0f}",
                f"**{per_beat * 3600 / DEFAULT_HEARTBEAT:,.0f}**",
            ]
        )
    per_beat = statistics.mean(totals) / beats if totals else math.nan
    at_default = per_beat * 3600 / DEFAULT_HEARTBEAT
    # Per awake space-hour, one wake held one hour: acquire + release + the renewals due within
    # the hour (every TTL/3); counted in "Lease requests per awake space-hour" when that ran.
    lease_hour = _lease_hour_expected(DEFAULT_TTL)
    mesh_hour = _lease_hour_expected(MESH_TTL)
    counted = {r["real_ttl"]: _lease_counted(r) for r in leases}
    lease_hour = counted.get(DEFAULT_TTL, lease_hour)
    mesh_hour = counted.get(MESH_TTL, mesh_hour)
    out += [
        f"### S3 requests for membership ({span:.0f} s idle, nothing awake, 3 boxes, "
        f"{hb * 1000:g} ms heartbeat ≈ {beats:.0f} beats per box)",
        "",
        benchlib.table(
            [
                "box",
                "requests in the window (router metrics)",
                "per beat",
                f"per box-hour at {hb * 1000:g} ms",
                "per box-hour at 15 s",
            ],
            rows,
        ),
        "",
        f"- Each beat is one PUT of the heartbeat and one LIST of the members (the LIST's `Date` "
        f"serves `now()`, no HEAD; peers' bodies are fetched only when their ETag changes, i.e. "
        f"once per peer restart). At the default 15 s heartbeat: **{at_default:,.0f} requests "
        f"per box-hour** ({at_default / 2:,.0f} PUT + {at_default / 2:,.0f} LIST), "
        f"{at_default * 24 * 30:,.0f} per box-month; a fleet of N boxes pays N times that (each "
        f"box both beats and lists).",
        f"- Against the lease: a space awake one hour held its lease for {lease_hour:.0f} "
        f"requests with per-space renewals (acquire, a renewal every "
        f"{DEFAULT_TTL / 3 / 60:.0f} min, release; off a mesh still) and {mesh_hour:.0f} on a "
        f"mesh box since issue 18 (a renewal every {MESH_TTL / 3 / 60:.0f} min), so one box's "
        f"membership costs as much as ≈ {at_default / lease_hour:.0f} awake space-hours of "
        f"per-space leases, or ≈ {at_default / mesh_hour:.0f} of mesh leases: the heartbeat "
        f"that fences them. Both are PUT/LIST-class requests ($0.005 per 1,000 on S3 "
        f"Standard): membership ≈ ${at_default * 0.005 / 1000 * 24 * 30:.2f} per box-month.",
        "",
    ]

    return out


def _lease_hour_expected(real_ttl: float) -> float:
    """Lease requests of one wake held one hour: acquire + release + the renewals due within it
    (every TTL/3; the one due at the hour itself counted, as a release comes after it)."""
    return 2 + math.floor(3600 / (real_ttl / 3) + 1e-9)


def _lease_counted(run: dict[str, Any]) -> float:
    """The median over the run's spaces of their ``lock.json`` requests (moto's log)."""
    return med([h["total"] for h in run["hosts"].values()])


def _lease_section(runs: list[dict[str, Any]]) -> list[str]:
    hour = runs[0]["hour"]
    scale = runs[0]["scale"]
    rows = []
    for r in runs:
        label = (
            f"{_duration(r['real_ttl'])} → {r['ttl']:g} s "
            f"({'mesh default' if r['real_ttl'] == MESH_TTL else 'per-space renewals'})"
        )
        for host, h in r["hosts"].items():
            rows.append(
                [
                    label,
                    f"{host.split('.')[0]} ({h['box']})",
                    f"{h['held']:.1f} s = {h['held'] / hour * 60:.0f} min",
                    ", ".join(f"{k}: {v}" for k, v in sorted(h["requests"].items())) or "-",
                    f"**{h['total']}**",
                    str(h["renewals"]),
                    f"{med(h['periods']):.2f} s ({r['ttl'] / 3:.2f} s)" if h["periods"] else "-",
                ]
            )
    by_ttl = {r["real_ttl"]: r for r in runs}
    ours, before = by_ttl.get(MESH_TTL), by_ttl.get(DEFAULT_TTL)
    out = [
        f"### Lease requests per awake space-hour (a scaled hour: {hour:g} s stand for 1 h)",
        "",
        f"Every duration scaled by {scale:.5f} ({hour:g} s for an hour): the mesh default "
        f"`LCHAT_LEASE_TTL` (unset: {_duration(MESH_TTL)}) as {MESH_TTL * scale:g} s, the "
        f"per-space renewals every box had before (15 min) as {DEFAULT_TTL * scale:g} s, each on "
        f"the same three routers restarted with it (`LCHAT_MESH_HEARTBEAT="
        f"{runs[0].get('heartbeat', 0) * 1000:g}ms`; the heartbeat does not touch leases). Three "
        f"spaces per TTL, one per box, woken with `POST /wake`, awake {hour:g} s with no client "
        f"traffic, put to sleep with `POST /sleep`. A renewal every TTL/3, one acquire and one "
        f"release per wake: a count in a scaled hour is the count of a real one. Requests = every "
        f"request moto logged for the space's `lock.json` (method and status); renewals and the "
        f"period between them from the holder's log; held = its `acquired` to `released` (the "
        f"lease is held from before the restore to after the final flush, so a little longer "
        f"than the {hour:g} s awake).",
        "",
        benchlib.table(
            [
                "TTL (real → scaled)",
                "space (box)",
                "lease held (in real minutes)",
                "lock.json requests (moto's log)",
                "total",
                "renewals",
                "renewal period, median (TTL/3)",
            ],
            rows,
        ),
        "",
        "Router metrics over each run (`lchat_lease_operations_total`, three boxes summed): "
        + "; ".join(
            f"{_duration(r['real_ttl'])}: "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(r["operations"].items()))
            for r in runs
        )
        + ".",
        "",
    ]
    if ours is not None and before is not None:
        a, b = _lease_counted(ours), _lease_counted(before)
        out.append(
            f"- Counted per space awake one hour: **{a:g}** lease requests with the mesh default, "
            f"**{b:g}** with per-space renewals on the same mesh: **{b / a:.1f}x** fewer "
            f"(expected {_lease_hour_expected(MESH_TTL):g} and "
            f"{_lease_hour_expected(DEFAULT_TTL):g}: acquire, a renewal every TTL/3 = "
            f"{MESH_TTL / 3 / 60:g} min or {DEFAULT_TTL / 3 / 60:g} min, release)."
        )
        out.append(
            f"- Per awake space-hour over a long stay: {3600 / (MESH_TTL / 3):g} renewals an "
            f"hour against {3600 / (DEFAULT_TTL / 3):g}, plus the acquire and the release once "
            f"per wake (a PUT `If-None-Match` and a DELETE `If-Match`); so a space awake 1 h costs "
            f"{_lease_hour_expected(MESH_TTL):g}, awake 8 h "
            f"{2 + math.floor(8 * 3600 / (MESH_TTL / 3)):g} "
            f"({(2 + math.floor(8 * 3600 / (MESH_TTL / 3))) / 8:.2f} per hour), against "
            f"{_lease_hour_expected(DEFAULT_TTL):g} and "
            f"{2 + math.floor(8 * 3600 / (DEFAULT_TTL / 3)):g}."
        )
    out.append(
        "- Not counted here (no client traffic): a box that forwards requests to the holder "
        "reads `lock.json` at most once per 2 s per forwarded host (see Forwarding); a survivor "
        "asking a held lease during a failover; the heartbeat, which is per box (see "
        "membership)."
    )
    return out


def _lease_goal(runs: list[dict[str, Any]]) -> list[str]:
    by_ttl = {r["real_ttl"]: r for r in runs}
    ours, before = by_ttl.get(MESH_TTL), by_ttl.get(DEFAULT_TTL)
    if ours is None:
        return []
    a = _lease_counted(ours)
    line = (
        f"- ≤ {LEASE_GOAL:g} lease requests per awake space-hour: {mark(a <= LEASE_GOAL)} "
        f"({a:g} counted for a space awake one scaled hour with the mesh default TTL"
    )
    if before is not None:
        b = _lease_counted(before)
        line += f"; {b:g} with per-space renewals (15 min TTL) on the same mesh, {b / a:.1f}x"
    return [line + ")"]


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def _default_kill_section(trials: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    hb, dead = trials[0]["heartbeat"], trials[0]["dead_after"]
    ttl = trials[0].get("ttl", math.nan)
    goal = dead + KILL_GOAL_SLACK
    rows = []
    for t in trials:
        written = t.get("lease_written")
        rows.append(
            [
                f"{t['owner']} → {t['woke_on'] or '?'} (asked {t['target']})",
                f"**{sec(t['serve'])}**",
                (sec(t.get("beat_seen")) + " (LM " + sec(-t["beat_lm"]) + ")")
                if t.get("beat_lm") is not None
                else sec(t.get("beat_seen")),
                sec(t.get("hb_takeable")),
                f"{sec(t['judged'])} ({t['judged_age']:.1f} s)"
                if t.get("judged_age") is not None
                else sec(t.get("judged")),
                f"{sec(t['taken_over'])} ({t.get('takeover_reason') or '?'})",
                _wake_cell(t),
                (
                    f"{written + math.ceil(DEFAULT_TTL):.0f} s / "
                    f"{written + math.ceil(MESH_TTL):.0f} s"
                )
                if written is not None
                else "-",
                str(t["held"]),
                _statuses(t),
                f"{t['other_cpu'] * 100:.0f}%",
            ]
        )

    def m(key: str) -> float:
        return med([t.get(key) for t in trials])

    def md(f: Callable[[dict[str, Any]], float | None]) -> float:
        return med([f(t) for t in trials])

    def diff(a: str, b: str) -> Callable[[dict[str, Any]], float | None]:
        def f(t: dict[str, Any]) -> float | None:
            x, y = t.get(a), t.get(b)
            return None if x is None or y is None else x - y

        return f

    serve = [t["serve"] for t in trials]
    ok = [x for x in serve if x == x]
    worst = max(ok, default=math.nan)
    lag = md(diff("taken_over", "hb_takeable"))
    wake = md(lambda t: t["timings"].get("total"))
    to_answer = md(diff("serve", "awake"))
    rest = md(diff("awake", "taken_over"))  # restore, spawn, ready, replicate
    lease_phase = md(lambda t: t["timings"].get("lease"))
    reasons: dict[str, int] = {}
    for t in trials:
        key = str(t.get("takeover_reason"))
        reasons[key] = reasons.get(key, 0) + 1
    ttl15 = md(
        lambda t: (
            t["lease_written"] + math.ceil(DEFAULT_TTL)
            if t.get("lease_written") is not None
            else None
        )
    )
    ttl2h = md(
        lambda t: (
            t["lease_written"] + math.ceil(MESH_TTL) if t.get("lease_written") is not None else None
        )
    )
    out = [
        f"### kill -9 failover at the default heartbeat ({len(trials)} trials; SIGKILL to the "
        f"owner 1.5 s after the post)",
        "",
        f"`LCHAT_MESH_HEARTBEAT={hb:g}s`, `LCHAT_MESH_DEAD_AFTER={dead:g}s` (the defaults), "
        f"`LCHAT_LEASE_TTL` unset (a mesh box's default: {_duration(ttl)}, renewed every "
        f"{_duration(ttl / 3)}), `PEER_DIAL_RETRY` unpatched. A survivor polled every "
        f"{args.poll * 1000:g} ms ({args.clients} kept-alive client connections opened before) "
        f"for up to dead_after + 60 s. The kills are spread over one heartbeat period: trial i "
        f"of {len(trials)} kills the owner {KILL_PHASE_OFFSET:g} s + i·{hb:g}/{len(trials)} s "
        f"after one of its heartbeat PUTs landed (seen in moto's access log), so the first is "
        f"the worst case (a kill right after a beat: the full dead_after still to wait) and the "
        f"median trial's phase is close to a random kill's median ({hb / 2:g} s). Times from the "
        f"kill, one clock: served = the first 200 "
        f"holding the message; last beat = how long before the kill the killed box's last "
        f"heartbeat landed (moto's log), and its `Last-Modified` as the store keeps it "
        f"(truncated to the second, read from moto); takeable = when the heartbeat rule let a peer take its leases (the "
        f"bucket's clock at floor(LM) + 1 s + dead_after, lchat/mesh/fence.py); judged dead = "
        f"the survivor's `lease <host>: holder <box> is dead (last heartbeat …s ago …)`, with "
        f"the age it computed on the bucket's clock; taken over = its `taken over from …` line "
        f"and the reason; awake = its wake (lease / restore / spawn / ready / replicate); by TTL "
        f"= when the lease could have been taken by its TTL alone (the lease's `Last-Modified`: "
        f"floor + 1 s + ceil(TTL)), with a 15 min TTL (per-space renewals) and the 2 h default; "
        f"lease held = wakes answered 503 `lease_held` meanwhile.",
        "",
        benchlib.table(
            [
                "owner → woke on",
                "served",
                "last beat before the kill (LM)",
                "takeable (heartbeat rule)",
                "judged dead (heartbeat age judged)",
                "taken over (reason)",
                "awake (wake total: phases)",
                "by TTL: 15 min / 2 h",
                "lease held",
                "answers (status: n)",
                "other CPU",
            ],
            rows,
        ),
        "",
        _detail_table(trials),
        "",
        f"Medians: served **{sec(med(serve))}** after the kill (max {sec(worst)}; goal ≤ "
        f"dead_after + {KILL_GOAL_SLACK:g} s = {goal:g} s: {mark(med(serve) <= goal)} at the "
        f"median; for every trial {mark(worst <= goal)}, "
        f"{sum(1 for x in ok if x > goal)} of {len(ok)} over). Made of: the heartbeat rule allowed "
        f"the takeover at {sec(m('hb_takeable'))} (the kill came {sec(-m('beat_lm'))} after "
        f"the last beat was written: a kill lands anywhere in a {hb:g} s heartbeat, so this is "
        f"dead_after + 1 s - that, between {dead + 1 - hb:g} and {dead + 1:g} s); the survivor "
        f"took over {sec(lag)} after that (it judges on the bucket's `Date`, truncated to the "
        f"second and extrapolated from its last answer, at its next wake attempt: requests try "
        f"one at most every 0.25 s, each asking the held lease again for ~0.7 s); the space "
        f"was awake {sec(rest)} after the takeover (restore, spawn, ready, replicate; the "
        f"successful wake took {sec(wake)} in all, its first {sec(lease_phase)} asking the "
        f"held lease until the rule allowed it); the answer came {ms(to_answer)} after that. "
        f"Takeover reasons: "
        + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
        + f". By its TTL alone the lease would have been takeable at {sec(ttl15)} with "
        f"per-space renewals (15 min; a freshly woken space: a kill at a random point of its "
        f"renewal cycle lands in (600, 901] s) and {sec(ttl2h)} with the 2 h default: the "
        f"heartbeat serves it **{ttl15 / med(serve):.0f}x** sooner than the 15 min TTL did.",
    ]
    if worst > goal or med(serve) > goal:
        out.append(
            f"\n**The goal is not met** in {sum(1 for x in ok if x > goal)} of {len(ok)} "
            f"trials. The time is detection + wake. Detection is dead_after ({dead:g} s) from "
            f"the last beat, plus what the whole-second clocks lose: the rule counts from "
            f"floor(`Last-Modified`) + 1 s (0-1 s after the beat landed) and the survivor reads "
            f"the bucket's clock from a `Date` truncated to the second (0-1 s late), plus its "
            f"next wake attempt; a kill just after a beat therefore waits dead_after + ~1 s "
            f"before anything can happen, and the rest of the wake (restore, spawn, the "
            f"reference space's start on 2 shared cores: {sec(rest)} at the median) comes on "
            f"top. Shorter: a shorter dead_after (it is almost all of it; a 5 s / 15 s heartbeat "
            f"costs 3x the membership requests); a taker threshold a little below dead_after "
            f"(the holder stops writing at dead_after - margin, {dead * 0.9:g} s, so judging at "
            f"dead_after - 1 s would still leave {dead * 0.1 - 1:g} s for clock-rate error); a "
            f"faster wake (a warm copy, a space that starts faster)."
        )
    else:
        out.append(
            f"\nWorst case by the rule: a kill right after a beat landed waits dead_after + 1 s "
            f"({dead + 1:g} s) for the rule, then the survivor's next attempt and the rest of "
            f"the wake ({sec(lag + rest + to_answer)} here at the median): ≈ "
            f"{dead + 1 + lag + rest + to_answer:.1f} s against the goal's {goal:g} s, a margin "
            f"of {goal - (dead + 1 + lag + rest + to_answer):.1f} s for a slow wake on a loaded "
            f"machine."
        )
    return out


def _default_kill_goal(trials: list[dict[str, Any]]) -> list[str]:
    if not trials:
        return []
    dead = trials[0]["dead_after"]
    goal = dead + KILL_GOAL_SLACK
    serve = [t["serve"] for t in trials]
    worst = max((x for x in serve if x == x), default=math.nan)
    written = [t["lease_written"] for t in trials if t.get("lease_written") is not None]
    ttl15 = med([w + math.ceil(DEFAULT_TTL) for w in written])
    return [
        f"- kill -9 failover at the default heartbeat ≤ dead_after + {KILL_GOAL_SLACK:g} s = "
        f"{goal:g} s: {mark(worst <= goal)} (median {sec(med(serve))}, max {sec(worst)} over "
        f"{len(serve)} trials; with per-space renewals the lease alone kept it dark "
        f"{sec(ttl15)} for these spaces, up to 15 min)"
    ]


def _statuses(t: dict[str, Any]) -> str:
    parts = [f"{k}: {v}" for k, v in sorted(t["statuses"].items())]
    if t.get("pending"):
        parts.append(f"no answer after 20 s: {t['pending']}")
    s = ", ".join(parts)
    if t.get("old_owner_served"):
        s += f" ({t['old_owner_served']} of the 200s still from the stopping owner)"
    if t.get("retry_after", math.nan) == t.get("retry_after", math.nan):
        s += f"; 503 Retry-After up to {t['retry_after']:g} s"
    if t["max_wait"] > 1:
        s += f"; slowest unserved {t['max_wait']:.1f} s"
    return s


def _detail_table(trials: list[dict[str, Any]]) -> str:
    """Per trial: what the survivors' routers counted between the signal and the first served
    answer, and the same space's cold wake done again afterwards with nothing else going on."""

    def kv(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items())) or "-"

    rows = []
    for t in trials:
        tm, om = t["target_metrics"], t["other_metrics"]
        ref = t.get("reference") or {}
        rt = ref.get("timings") or {}
        phases = " / ".join(
            ms(rt.get(p)) for p in ("lease", "restore", "spawn", "ready", "replicate")
        )
        rows.append(
            [
                f"{t['owner']} → {t['woke_on'] or '?'}",
                f"{t['target']}: {kv(tm['routing'])}",
                f"{t['other']}: {kv(om['routing'])}",
                kv({f"{k} ({t['target']})": v for k, v in tm["unavailable"].items()})
                + "; "
                + kv({f"{k} ({t['other']})": v for k, v in om["unavailable"].items()}),
                f"{tm['dial_retries']:g}",
                f"{kv(tm['s3'])} (GET mean {ms(tm['get_mean'], 1)})",
                f"{ref.get('box', '-')}: {ms(rt.get('total'))} ({phases})" if rt else "-",
            ]
        )
    return benchlib.table(
        [
            "trial",
            "routing, polled survivor",
            "routing, other survivor",
            "503s by reason",
            "dial retries (polled)",
            "S3 requests (polled)",
            "reference cold wake, no failover (phases)",
        ],
        rows,
    )


PHASE_NAMES = ("lease", "restore", "spawn", "ready", "replicate")


def peer_dial_retry() -> float | None:
    """lchat/proxy/upstream.py's dial retry towards mesh peers (None before ee59ef9)."""
    from lchat.proxy import upstream

    value = getattr(upstream, "PEER_DIAL_RETRY", None)
    return float(value) if value is not None else None


def _wake_cell(t: dict[str, Any]) -> str:
    tm = t["timings"]
    phases = " / ".join(ms(tm.get(p)) for p in PHASE_NAMES)
    return f"{sec(t['awake'])} ({ms(tm.get('total'))}: {phases})"


def _learned(t: dict[str, Any]) -> float | None:
    """When the polled survivor stopped sending requests to the owner: its membership read
    dropped it, or a refused forward made it route without it, whichever came first."""
    times = [x for x in (t["gone_target"], t["fallback_target"]) if x is not None]
    return min(times) if times else None


def _failover_section(
    trials: list[dict[str, Any]], kind: str, what: str, args: argparse.Namespace
) -> list[str]:
    hb, dead = trials[0]["heartbeat"], trials[0]["dead_after"]
    ttl = args.lease_ttl
    rows = []
    for t in trials:
        first_cols = [
            f"{t['owner']} → {t['woke_on'] or '?'} (asked {t['target']})",
            f"**{sec(t['serve'])}**",
        ]
        if kind == "graceful":
            rows.append(
                [
                    *first_cols,
                    sec(t["deleted"]),
                    sec(t["released"]),
                    sec(t["exit"]),
                    sec(t["gone_target"]),
                    sec(t["fallback_target"]),
                    sec(t["gone_other"]),
                    sec(t["acquired"]),
                    _wake_cell(t),
                    str(t["held"]),
                    _statuses(t),
                    f"{t['other_cpu'] * 100:.0f}%",
                ]
            )
        else:
            rows.append(
                [
                    *first_cols,
                    f"{sec(t.get('lease_expiry'))} (renewed {sec(t.get('lease_age'))} before)",
                    sec(t.get("member_dead")),
                    sec(t["gone_target"]),
                    sec(t["fallback_target"]),
                    sec(t["gone_other"]),
                    sec(t["taken_over"]),
                    _wake_cell(t),
                    str(t["held"]),
                    _statuses(t),
                    f"{t['other_cpu'] * 100:.0f}%",
                ]
            )
    if kind == "graceful":
        title = f"### Graceful failover ({what}; SIGTERM to the owner)"
        legend = (
            "hb deleted = the owner's drain deleted its heartbeat; released = it released the "
            "space's lease (after stopping the space and flushing); exit = its process ended"
        )
        head = ["hb deleted", "released", "exit"]
    else:
        title = f"### kill -9 failover ({what}; SIGKILL to the owner 1.5 s after the post)"
        legend = (
            "lease expiry = when the killed owner's lease may be taken over (its `Last-Modified`, "
            "read from moto after the kill: floor + 1 s + ceil(TTL)), and how long before the "
            "kill its last renewal was answered; member dead = its last heartbeat's "
            "`Last-Modified` + dead_after"
        )
        head = ["lease expiry", "member dead"]
    out = [
        title,
        "",
        f"`LCHAT_MESH_HEARTBEAT={hb:g}s`, `LCHAT_MESH_DEAD_AFTER={dead:g}s`, "
        f"`LCHAT_LEASE_TTL={ttl:g}s`. A survivor polled every {args.poll * 1000:g} ms "
        f"({args.clients} kept-alive client connections opened before). Times from the signal, "
        "on one clock (the routers' log events carry `time.time()`): served = the first 200 "
        f"holding the message, from the survivor; {legend}; gone = the survivor's membership "
        "read dropped the owner (asked = the polled box, other = the third box); re-routed = "
        "the polled box's first forward refused by the owner's closed port, routed again "
        "without it (`peer ... unreachable ... routing without it`); acquired / awake = the "
        "survivor's wake (lease / restore / spawn / ready / replicate); lease held = wakes "
        "refused while the lease was still held; other CPU = what processes not ours (other "
        "sessions' tests, on this shared machine) used during the trial, % of one core.",
        "",
        benchlib.table(
            [
                "owner → woke on",
                "served",
                *head,
                "gone (asked)",
                "re-routed (asked)",
                "gone (other)",
                "acquired" if kind == "graceful" else "taken over",
                "awake (wake total: phases)",
                "lease held",
                "answers (status: n)",
                "other CPU",
            ],
            rows,
        ),
        "",
        _detail_table(trials),
        "",
    ]

    def m(key: str) -> float:
        return med([t.get(key) for t in trials])

    def md(f: Callable[[dict[str, Any]], float | None]) -> float:
        return med([f(t) for t in trials])

    learned = md(_learned)
    wake = md(lambda t: t["timings"].get("total"))
    ready = md(lambda t: t["timings"].get("ready"))
    ref = md(lambda t: ((t.get("reference") or {}).get("timings") or {}).get("total"))
    ref_ready = md(lambda t: ((t.get("reference") or {}).get("timings") or {}).get("ready"))
    to_answer = md(lambda t: t["serve"] - t["awake"] if t["awake"] is not None else None)
    gate = "released" if kind == "graceful" else "taken_over"
    after_gate = md(
        lambda t: (
            (t["acquired"] - max(t[gate], _learned(t) or 0.0))
            if t["acquired"] is not None and t[gate] is not None
            else None
        )
    )
    fallback_first = [t for t in trials if (t["fallback_target"] or 99) < (t["gone_target"] or 99)]
    if kind == "graceful":
        text = (
            f"Medians: served **{sec(m('serve'))}**. The owner deleted its heartbeat at "
            f"{sec(m('deleted'))}, released the lease at {sec(m('released'))} (stop + flush + "
            f"release {sec(md(lambda t: t['released'] - t['sleeping'] if t['released'] is not None and t['sleeping'] is not None else None))}) "
            f"and exited at {sec(m('exit'))}. The polled survivor stopped sending to it at "
            f"{sec(learned)}: its membership read (gone, {sec(m('gone_target'))}; uniform over "
            f"one {hb:g} s heartbeat) or a refused forward re-routed after the peer dial retry "
            f"(re-routed, {sec(m('fallback_target'))}), whichever came first "
            f"({len(fallback_first)} of {len(trials)} trials: the re-route). The wake then "
            f"started {sec(after_gate)} after the later of that and the release"
        )
    else:
        text = (
            f"Medians: served **{sec(m('serve'))}**. The lease could be taken over at "
            f"{sec(m('lease_expiry'))} (renewals every {ttl / 3:.2f} s and `Last-Modified` "
            f"truncated to the second put expiry after a kill anywhere in (2·TTL/3, TTL + 1] = "
            f"({ttl * 2 / 3:.1f}, {ttl + 1:.1f}] s); the member was dead by its heartbeat at "
            f"{sec(m('member_dead'))}, dropped by the polled survivor at "
            f"{sec(m('gone_target'))}, and the first refused forward re-routed at "
            f"{sec(m('fallback_target'))}; taken over at {sec(m('taken_over'))}, the wake "
            f"starting {sec(after_gate)} after the takeover was possible"
        )
    text += (
        f"; the wake took {sec(wake)} ({sec(ready)} of it waiting for the reference space to "
        f"start) and the answer came {ms(to_answer)} after it. The same cold wake repeated "
        f"with no failover traffic: {sec(ref)} ({sec(ref_ready)} ready); the difference is "
        f"the load of the failover on 2 shared cores."
    )
    out.append(text)

    quick = [w for t in trials for w in t["fail502"] if w < 1.0]
    slow = [w for t in trials for w in t["fail502"] if w >= 5.0]
    rerouted = sum(t["target_metrics"]["routing"].get("peer_unreachable", 0) for t in trials)
    served_waits = [w for t in trials for w in t["served_waits"]]
    retry = trials[0].get("patched")
    if retry is None:
        retry = peer_dial_retry()
    if rerouted:
        out.append(
            f"\n{rerouted:g} requests reached the polled survivor while its view still had the "
            f"owner, were forwarded, refused, and routed again without it after the peer dial "
            f"retry (`PEER_DIAL_RETRY`, {retry:g} s); the slowest served request waited "
            f"{sec(max(served_waits, default=math.nan))}."
        )
    if quick:
        out.append(
            f"\n{len(quick)} requests got a **502 at once** ({ms(min(quick))} to "
            f"{ms(max(quick))}): in flight to the owner at the signal, they were cut by its "
            f"shutdown and the survivor logged `upstream for <host> failed: closed before "
            f"responding`; the re-route covers only dial failures, so they were not routed "
            f"again."
        )
    if slow:
        out.append(
            f"\n{len(slow)} requests got a 502 after {sec(min(slow))} to {sec(max(slow))}: "
            f"forwarded to the stopped owner and re-dialled for the whole dial retry."
        )
    held = [t for t in trials if t["held"]]
    if held and kind == "graceful":
        out.append(
            f"\nIn {len(held)} trial(s) the survivor tried to wake the space before the drain "
            f"had released the lease: 503 `lease_held` with Retry-After up to "
            f"{max(t['retry_after'] for t in held):g} s (a client honouring it waits that long "
            f"for a lease released a fraction of a second later; with the production TTL the "
            f"cap, 10 s, applies)."
        )
    if kind == "kill":
        reasons: dict[str, int] = {}
        for t in trials:
            key = str(t.get("takeover_reason"))
            reasons[key] = reasons.get(key, 0) + 1
        out.append(
            f"\nWhat decides (issue 18, docs/lease.md): the survivor may take the lease when its "
            f"TTL has passed or, sooner, when the killed box is dead by the heartbeat rule (the "
            f"bucket's clock at floor(heartbeat Last-Modified) + 1 s + dead_after: "
            f"{sec(med([t.get('hb_takeable') for t in trials]))} here at the median, against "
            f"{sec(m('lease_expiry'))} by the TTL). Until then every request that reaches a "
            f"survivor tries a wake and gets 503 `lease_held`. Takeover reasons: "
            + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
            + f". With dead_after {dead:g} s and a {ttl:g} s TTL the two are close; at the "
            f"defaults (dead_after 45 s, TTL 2 h on a mesh box, 15 min before) the heartbeat "
            f"decides: see the kill -9 failover at the default heartbeat."
        )
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="kept-alive requests per path")
    parser.add_argument("--fresh", type=int, default=100, help="new-connection requests per path")
    parser.add_argument("--graceful", type=int, default=5, help="graceful failover trials")
    parser.add_argument("--kills", type=int, default=3, help="kill -9 failover trials")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds")
    parser.add_argument("--dead-after", type=float, default=None, help="seconds (3 x heartbeat)")
    parser.add_argument("--lease-ttl", type=float, default=5.0, help="seconds (at least 3)")
    parser.add_argument("--idle", type=float, default=30.0, help="membership window, seconds")
    parser.add_argument("--poll", type=float, default=0.025, help="failover poll interval")
    parser.add_argument(
        "--clients", type=int, default=32, help="poller connections opened before each failover"
    )
    parser.add_argument(
        "--default-hb-trials",
        type=int,
        default=3,
        help="graceful trials again with the default 15 s heartbeat / 45 s dead-after (0 skips)",
    )
    parser.add_argument(
        "--patched-trials",
        type=int,
        default=3,
        help="graceful trials at the default heartbeat with PEER_DIAL_RETRY patched to "
        "--patched-retry in the routers (0 skips)",
    )
    parser.add_argument("--patched-retry", type=float, default=0.0, help="seconds")
    parser.add_argument(
        "--default-hb-kills",
        type=int,
        default=5,
        help="kill -9 trials at the default 15 s heartbeat / 45 s dead-after and the mesh "
        "default lease TTL (0 skips; ~70 s each)",
    )
    parser.add_argument(
        "--lease-hour",
        type=float,
        default=30.0,
        help="seconds that stand for one hour in the lease-requests count (every TTL scaled "
        "alike; at least 12: the 15 min TTL must scale to >= 3 s)",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections to run: " + ", ".join(SECTIONS),
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir and logs")
    args = parser.parse_args()
    if args.dead_after is None:
        args.dead_after = 3 * args.heartbeat
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    if DEFAULT_TTL * args.lease_hour / 3600 < 3:
        parser.error("--lease-hour must be at least 12 (LCHAT_LEASE_TTL >= 3 s)")
    # A section not asked for runs no trials.
    for section, attr in (
        ("graceful", "graceful"),
        ("kills", "kills"),
        ("default-graceful", "default_hb_trials"),
        ("patched", "patched_trials"),
        ("default-kills", "default_hb_kills"),
    ):
        if section not in only:
            setattr(args, attr, 0)
    args.only = ",".join(x for x in SECTIONS if x in only)
    try:
        import boto3  # type: ignore[import-untyped]  # noqa: F401

        from tests.s3servers import BIN as MOTO_BIN

        if not os.access(os.path.join(MOTO_BIN, "moto_server"), os.X_OK):
            raise ImportError(f"no moto_server in {MOTO_BIN}")
    except ImportError as e:
        sys.exit(f"bench/mesh.py needs the test extras (boto3, moto): {e}")
    benchlib.raise_nofile()
    info = benchlib.machine()
    started = time.time()
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        mesh = Mesh(tmp, procs, args)
        try:
            initial = bool(only & {"forwarding", "graceful", "kills", "membership"})
            lease_runs: list[float | None] = [None, DEFAULT_TTL] if "lease-requests" in only else []
            hosts_ = [
                *([f"fwd.{DOMAIN}"] if "forwarding" in only else []),
                *(f"g{i}.{DOMAIN}" for i in range(args.graceful)),
                *(f"k{i}.{DOMAIN}" for i in range(args.kills)),
                *(f"d{i}.{DOMAIN}" for i in range(args.default_hb_trials)),
                *(f"p{i}.{DOMAIN}" for i in range(args.patched_trials)),
                *(f"dk{i}.{DOMAIN}" for i in range(args.default_hb_kills)),
                *(h for ttl in lease_runs for h in lease_hosts(_lease_tag(ttl))),
            ]
            mesh.add_spaces(hosts_)
            fwd: dict[str, Any] | None = None
            cost: dict[str, Any] | None = None
            converge_s: float | None = None
            graceful: list[dict[str, Any]] = []
            kills: list[dict[str, Any]] = []
            if initial:
                log("starting three routers")
                t = time.time()
                mesh.start_all()
                converge_s = time.time() - t
                log(f"mesh up in {converge_s:.1f}s: {', '.join(b.url for b in mesh.boxes)}")
            if "forwarding" in only:
                fwd = forwarding(mesh, args)
                log(
                    "forwarding: p50 direct "
                    f"{ms(statistics.median(fwd['lat']['direct']), 2)}, forwarded "
                    f"{ms(statistics.median(fwd['lat']['forwarded']), 2)}"
                )
            graceful = [failover_trial(mesh, args, "graceful", i) for i in range(args.graceful)]
            kills = [failover_trial(mesh, args, "kill", i) for i in range(args.kills)]
            if "membership" in only:
                log(f"membership: {args.idle:g}s idle")
                cost = membership_cost(mesh, args)
            leases: list[dict[str, Any]] = []
            for real_ttl in lease_runs:
                log(
                    f"lease requests: LCHAT_LEASE_TTL "
                    f"{'unset (the mesh default)' if real_ttl is None else f'{real_ttl:g}s'}, "
                    f"scaled to an hour of {args.lease_hour:g}s"
                )
                leases.append(lease_requests(mesh, args, real_ttl, _lease_tag(real_ttl)))
                r = leases[-1]
                log(
                    f"lease requests at {r['ttl']:g}s: "
                    + "; ".join(f"{h}: {v['total']} {v['requests']}" for h, v in r["hosts"].items())
                )
            slow_hb: list[dict[str, Any]] = []
            patched: list[dict[str, Any]] = []
            for n, prefix, patch in (
                (args.default_hb_trials, "d", None),
                (args.patched_trials, "p", args.patched_retry),
            ):
                if not n:
                    continue
                log(
                    "the mesh again with the default 15 s heartbeat"
                    + (f", PEER_DIAL_RETRY patched to {patch:g} s" if patch is not None else "")
                )
                mesh.restart(DEFAULT_HEARTBEAT, DEFAULT_DEAD_AFTER, args.lease_ttl, patch)
                trials = [
                    failover_trial(mesh, args, "graceful", i, prefix=prefix) for i in range(n)
                ]
                for trial in trials:
                    trial["patched"] = patch
                (slow_hb if patch is None else patched).extend(trials)
            dkills: list[dict[str, Any]] = []
            if args.default_hb_kills:
                log(
                    "the mesh again with the default 15 s heartbeat and LCHAT_LEASE_TTL unset: "
                    f"{args.default_hb_kills} kill -9 trials"
                )
                mesh.restart(DEFAULT_HEARTBEAT, DEFAULT_DEAD_AFTER, None)
                # The kill's phase in the owner's heartbeat decides most of the failover (the
                # rule counts dead_after from the last beat): spread it evenly over one period,
                # the first trial right after a beat landed (the worst case).
                dkills = [
                    failover_trial(
                        mesh,
                        args,
                        "kill",
                        i,
                        prefix="dk",
                        deadline=mesh.dead + 60.0,
                        beat_phase=KILL_PHASE_OFFSET + i * mesh.hb / args.default_hb_kills,
                    )
                    for i in range(args.default_hb_kills)
                ]
            log("stopping the mesh")
            mesh.stop_all()
            orphans = mesh.kill_orphans()
            if orphans:
                log(f"killed {orphans} orphaned space(s)")
        finally:
            for box in mesh.boxes:
                if box.alive():
                    with contextlib.suppress(ProcessLookupError):
                        box.signal(signal.SIGTERM)
            for box in mesh.boxes:
                if box.proc is not None and box.alive():
                    box.wait_exit(30)
            mesh.kill_orphans()
            mesh.close()

    text = "\n".join(
        [
            "## Mesh: forwarding, failover and membership cost (`bench/mesh.py`)",
            "",
            benchlib.machine_markdown(
                {k: info[k] for k in ("date", "commit", "cpus", "memory", "python", "twisted")}
            ),
            f"- run time: {time.time() - started:.0f} s",
            "",
            report(args, fwd, graceful, kills, cost, converge_s, slow_hb, patched, leases, dkills),
            "",
        ]
    )
    print(text)
    Path("/tmp/mesh-section.md").write_text(text)
    log("wrote /tmp/mesh-section.md")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-router"]:
        child_router(sys.argv[2:])
    else:
        main()

"""Wake latency: warm and cold wakes of hibernating spaces through a real router, the space's bare
start measured in the same run, and how many awake spaces one box holds.

    /tmp/venv/bin/python bench/wake.py [--rounds 20] [--cold-rounds 8] [--sizes 10,100]
        [--buckets file,moto] [--capacity 20,50,100] [--fine-poll 0.005] [--alt-poll 0.2]
        [--keep]
    /tmp/venv/bin/python bench/wake.py --limit N [--limit-wakes 20]

(~3.5 min with the defaults on 2 cores. The moto bucket needs the test extras — boto3, moto — as
tests/s3servers.py does; /tmp/venv/bin/python has them. Without them it is skipped, and said so.)
Prints a Markdown section and writes it to /tmp/wake-section.md.

What runs: per bucket (``file:`` in the temp dir; a moto server on loopback, started the way
tests/s3servers.py starts it, with ``LCHAT_HIBERNATE_ENDPOINT`` and AWS credentials in the router's
environment), ``twistd -n --pidfile= lchat --env-file <tmp>/<name>.env`` with
``LCHAT_UNITS=builtin``, ``LCHAT_SPACE_COMMAND=<python> -m lchat.space`` and
``LCHAT_HIBERNATE_BUCKET``. Hosts are registered with ``lchat add-instance --hibernate`` (in this
process, before the router starts). One wake at a time:

- **bare start**: the reference space spawned directly (the environment the activator gives it),
  timed from spawn to the first 200 on ``GET /api/version`` over its unix socket, probing as
  ``RunningChild.wait_ready`` does (a probe at once, then one every interval): once at the
  activator's interval (read from lchat/hibernation/lifecycle.py's ``wait_ready`` call) and once every
  ``--fine-poll`` (the space's real start).
- **warm wake**: ``GET /api/version`` through the router's HTTP port to a sleeping space whose
  local DB was slept cleanly here; the client's time and the router's ``X-Lchat-Wake``; then
  ``POST /sleep`` on the admin socket (timed too). Each round is: bare start (the activator's
  interval), bare start (fine), warm wake + sleep, and the same warm wake + sleep on a second
  router whose ``wait_ready`` interval is patched to ``--alt-poll`` in its own process (lchat's
  files are not touched) — interleaved, so that all four meet the same load on a shared machine.
- **N MB**: spaces whose DB holds N MB of random rows (sqlite3, WAL mode) before their first wake;
  that first wake seeds the bucket and is reported apart. Warm wakes as above; **cold** wakes after
  deleting the local DB, -wal, -shm and the clean-sleep marker, so the activator restores it.
- **phases**: each wake's deltas of the router's ``lchat_wake_seconds_sum{phase=...}`` (GET
  /metrics on the admin socket before and after it).
- **overhead** = median warm wake - median bare start, both polled at the activator's interval
  (the goal's definition), with the paired median and a split: the ready wait beyond the space's
  real start (fine-polled), and everything outside the ready wait (client - ready phase).

Capacity: a fresh router on the moto bucket (else file); spaces woken with ``POST /wake``, 8 at a
time, up to each of ``--capacity`` (bounded by free memory). At each level: the router's RSS, PSS
and open fds, every space's RSS and PSS (``/proc/<pid>/smaps_rollup``), the CPU the router and the
spaces use over 5 s with no traffic, and one ``GET /api/version`` through the router to each.
"Other CPU" is what the rest of the machine used meanwhile (/proc/stat minus our process tree).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib
from benchlib import BIN, Processes, log

from lchat import hosts

PHASES = ("lease", "restore", "spawn", "ready", "replicate", "total")
INHERITED = ("PATH", "LANG", "LC_ALL", "TZ", "HOME", "PYTHONPATH", "TMPDIR")  # lchat/units.py
METRIC = re.compile(r'^lchat_wake_seconds_(sum|count)\{phase="(\w+)"\} (\S+)$', re.M)
DOMAIN = "bench.localhost"
SPACE_MIB_GUESS = 60  # for bounding --capacity by free memory before measuring


# ---------------------------------------------------------------- small HTTP clients


def admin(sock: Path, method: str, path: str, timeout: float = 120.0) -> tuple[int, bytes]:
    return benchlib.admin(sock, method, path, timeout)


def through_router(port: int, host: str, timeout: float = 120.0) -> tuple[int, str | None]:
    """GET /api/version for ``host`` through the router: (status, X-Lchat-Wake)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/api/version", headers={"Host": host})
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("x-lchat-wake")
    finally:
        conn.close()


def probe(path: str, host: str) -> bool:
    """One readiness probe, as wait_ready makes it: GET /api/version answered 200."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(
                f"GET /api/version HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            data = b""
            while len(data) < 12:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def wake_metrics(sock: Path) -> dict[str, tuple[float, float]]:
    status, body = admin(sock, "GET", "/metrics")
    assert status == 200, status
    out: dict[str, list[float]] = {}
    for kind, phase, value in METRIC.findall(body.decode()):
        out.setdefault(phase, [0.0, 0.0])[0 if kind == "sum" else 1] = float(value)
    return {p: (v[0], v[1]) for p, v in out.items()}


def phase_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Each phase's seconds for the one wake between two scrapes."""
    out = {}
    for phase in PHASES:
        s0, n0 = before.get(phase, (0.0, 0.0))
        s1, n1 = after.get(phase, (0.0, 0.0))
        if n1 - n0 != 1:
            raise RuntimeError(f"phase {phase}: {n1 - n0:g} wakes between scrapes, expected 1")
        out[phase] = s1 - s0
    return out


# ---------------------------------------------------------------- statistics


def activator_poll() -> float:
    """The interval the activator's ``wait_ready`` call polls at: its ``interval=`` argument in
    lchat/hibernation/lifecycle.py, else ``RunningChild.wait_ready``'s default."""
    import ast
    import inspect

    from lchat import child
    from lchat.hibernation import lifecycle

    for node in ast.walk(ast.parse(inspect.getsource(lifecycle))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "wait_ready":
            for kw in node.keywords:
                if kw.arg == "interval":
                    if isinstance(kw.value, ast.Constant):
                        return float(kw.value.value)
                    log("the activator's wait_ready interval is not a constant: using the default")
    default = inspect.signature(child.RunningChild.wait_ready).parameters["interval"].default
    return float(default)


def every(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 0.1 else f"{seconds:g} s"


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.0f} ms"


# ---------------------------------------------------------------- databases and processes


def make_sized_db(path: Path, mb: int) -> None:
    """``mb`` MB of random 4000-byte rows in a table the space does not know, WAL mode."""
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("CREATE TABLE bench_filler(id INTEGER PRIMARY KEY, data BLOB)")
    c.execute("BEGIN")
    for _ in range(mb * 256):
        c.execute("INSERT INTO bench_filler(data) VALUES (randomblob(4000))")
    c.execute("COMMIT")
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()


def remove_db(db: str) -> None:
    for suffix in ("", "-wal", "-shm", "-lchat.json"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(db + suffix)


def add_instances(env_file: Path, names: Sequence[str]) -> None:
    """``lchat add-instance --hibernate`` for each host, in this process (the router is not up)."""
    from lchat.cli.main import main as lchat_main

    for host in names:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = lchat_main(["--env-file", str(env_file), "add-instance", "--hibernate", host])
        if code != 0:
            raise RuntimeError(f"add-instance {host}: {err.getvalue()}")


def mem_kib(pid: int, field: str) -> int:
    """Rss or Pss of ``pid`` from smaps_rollup, in KiB (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class OtherCPU:
    """CPU the machine spent on processes that are not ours, per section (% of one core)."""

    def __init__(self, live: list[int]) -> None:
        self.live = live  # pids we started and have not reaped yet (the moto server)
        self.sections: dict[str, float] = {}
        self._mark: tuple[float, float, float] | None = None

    def _ours(self) -> float:
        return benchlib.own_cpu_seconds() + sum(benchlib.tree_cpu(p) for p in self.live)

    def start(self) -> None:
        self._mark = (time.monotonic(), benchlib.busy_cpu_seconds(), self._ours())

    def end(self, name: str) -> None:
        assert self._mark is not None
        t, busy, ours = self._mark
        other = benchlib.busy_cpu_seconds() - busy - (self._ours() - ours)
        self.sections[name] = max(0.0, other) / max(time.monotonic() - t, 1e-9)


def fd_kinds(pid: int) -> dict[str, int]:
    """The open file descriptors of ``pid`` by kind."""
    out: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith(("pipe:", "socket:", "anon_inode:")):
            kind = target.split(":")[0]
        elif target.endswith((".db", ".db-wal", ".db-shm")):
            kind = "sqlite"
        else:
            kind = "other"
        out[kind] = out.get(kind, 0) + 1
    return out


def nofile_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return f"{soft} soft / {hard} hard"
    return "?"


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


class Router:
    """One ``twistd -n lchat`` with its own env file, data dir, run dir and bucket."""

    def __init__(
        self,
        procs: Processes,
        tmp: Path,
        name: str,
        bucket: dict[str, str],
        env: dict[str, str],
        ready_poll: float | None = None,
    ) -> None:
        self.procs, self.name, self.env = procs, name, env
        self.ready_poll = ready_poll
        self.data, self.run = tmp / f"{name}-data", tmp / f"{name}-run"
        self.data.mkdir()
        self.run.mkdir()
        self.port = benchlib.free_port()
        self.env_file = tmp / f"{name}.env"
        lines = [
            f"LCHAT_DATA_DIR={self.data}",
            f"LCHAT_RUN_DIR={self.run}",
            f"LCHAT_HTTP_ADDR=127.0.0.1:{self.port}",
            "LCHAT_HTTPS_ADDR=off",
            "LCHAT_UNITS=builtin",
            # One process, as every figure in docs/performance.md was measured (the default
            # is one per core): a wake's cost, not the workers' hop to the control process.
            "LCHAT_WORKERS=1",
            f"LCHAT_SPACE_COMMAND={sys.executable} -m lchat.space",
            *(f"{k}={v}" for k, v in bucket.items()),
            "",
        ]
        self.env_file.write_text("\n".join(lines))
        self.sock = self.run / "router.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def db(self, host: str) -> str:
        return hosts.db_path(str(self.data), host)

    def start(self) -> None:
        twistd = [str(BIN / "twistd")]
        if self.ready_poll is not None:
            twistd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child-router",
                f"{self.ready_poll}",
            ]
        self.proc = self.procs.start(
            self.name,
            [*twistd, "-n", "--pidfile=", "lchat", "--env-file", str(self.env_file)],
            env=self.env,
        )

        def up() -> bool:
            try:
                return admin(self.sock, "GET", "/status", timeout=2)[0] == 200
            except OSError:
                return False

        try:
            benchlib.wait_until(up, 30, f"router {self.name}", self.procs)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.procs.tail(self.name)}") from None
        time.sleep(0.5)  # the bucket probe

    def stop(self) -> None:
        self.procs.stop(self.proc, timeout=60)

    def wake_admin(self, host: str) -> float:
        t = time.perf_counter()
        status, body = admin(self.sock, "POST", f"/wake?host={host}")
        took = time.perf_counter() - t
        if status != 200:
            raise RuntimeError(f"wake {host}: {status} {body!r}\n{self.procs.tail(self.name)}")
        return took

    def sleep(self, host: str) -> float:
        t = time.perf_counter()
        status, body = admin(self.sock, "POST", f"/sleep?host={host}")
        took = time.perf_counter() - t
        if status != 200 or json.loads(body)["state"] != "asleep":
            raise RuntimeError(f"sleep {host}: {status} {body!r}")
        return took

    def wake_http(self, host: str) -> dict[str, Any]:
        """Wake ``host`` with a real request; the client's time, the header, the phases."""
        before = wake_metrics(self.sock)
        t = time.perf_counter()
        status, header = through_router(self.port, host)
        took = time.perf_counter() - t
        if status != 200:
            raise RuntimeError(f"GET {host}: {status}\n{self.procs.tail(self.name)}")
        if header is None:
            raise RuntimeError(f"GET {host}: no X-Lchat-Wake (was it awake already?)")
        phases = phase_delta(before, wake_metrics(self.sock))
        return {"client": took, "header": float(header.rstrip("s")), "phases": phases}

    def status(self) -> dict[str, Any]:
        status, body = admin(self.sock, "GET", "/status")
        assert status == 200, status
        result: dict[str, Any] = json.loads(body)
        return result


# ---------------------------------------------------------------- bare start


def bare_start(tmp: Path, db: Path, interval: float, tag: str) -> float:
    """Spawn the reference space directly; seconds from spawn to the first 200, polling like
    wait_ready (a probe at once, then one every ``interval``)."""
    host = f"bare.{DOMAIN}"
    sock = tmp / f"bare-{tag}.sock"
    env = {k: os.environ[k] for k in INHERITED if k in os.environ}
    env.update(
        LCHAT_HOST=host,
        LCHAT_SOCKET=str(sock),
        LCHAT_DB=str(db),
        LCHAT_ADMIN_TOKEN=secrets.token_urlsafe(32),
    )
    logf = open(tmp / f"bare-{tag}.log", "ab")
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lchat.space"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=logf,
        start_new_session=True,
    )
    logf.close()
    try:
        while True:
            if probe(str(sock), host):
                took = time.perf_counter() - t
                break
            if proc.poll() is not None:
                raise RuntimeError(f"bare space exited with {proc.returncode}")
            if time.perf_counter() - t > 30:
                raise RuntimeError("bare space not ready after 30 s")
            time.sleep(interval)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return took


# ---------------------------------------------------------------- the latency run


def latency_run(
    router: Router,
    sized: dict[int, Path],
    rounds: int,
    cold_rounds: int,
    bare: Callable[[float], float] | None = None,
    poll: float = 0.2,
    fine: float = 0.005,
    alt: Router | None = None,
) -> dict[str, Any]:
    """Warm wakes, then per size a seeding wake, warm and cold wakes. Each warm round also makes
    two bare starts (when ``bare`` is given: one polled at the activator's interval, one at
    ``fine``) and a warm wake on ``alt`` (the patched router), so that all four share the
    machine's conditions of the moment."""
    res: dict[str, Any] = {}
    warm = f"warm.{DOMAIN}"
    routers = [router] if alt is None else [router, alt]
    for r in routers:  # warm-up (imports, the S3 client's connection pool): not measured
        r.wake_admin(warm)
        r.sleep(warm)
    runs: list[dict[str, Any]] = [{"samples": [], "sleeps": [], "router_cpu": 0.0} for _ in routers]
    polled: list[float] = []
    polled_fine: list[float] = []
    for _ in range(rounds):
        if bare is not None:
            polled.append(bare(poll))
            polled_fine.append(bare(fine))
        for r, run in zip(routers, runs, strict=True):
            assert r.proc is not None
            cpu0 = benchlib.cpu_seconds([r.proc.pid])
            run["samples"].append(r.wake_http(warm))
            run["sleeps"].append(r.sleep(warm))
            run["router_cpu"] += (benchlib.cpu_seconds([r.proc.pid]) - cpu0) / rounds
    res["warm"] = runs[0]
    if alt is not None:
        res["alt"] = runs[1]
    res["bare"] = {"poll": polled, "fine": polled_fine}
    log(f"{router.name}: warm p50 {ms(statistics.median(s['client'] for s in runs[0]['samples']))}")

    for mb, src in sized.items():
        host = f"db{mb}.{DOMAIN}"
        shutil.copy(src, router.db(host))
        seed = router.wake_http(host)  # local DB, no marker: no restore; full snapshot upload
        seed_sleep = router.sleep(host)
        size = os.path.getsize(router.db(host))
        warm_s, warm_sl = [], []
        for _ in range(max(2, rounds // 6)):
            warm_s.append(router.wake_http(host))
            warm_sl.append(router.sleep(host))
        cold_s, cold_sl = [], []
        for _ in range(cold_rounds if mb <= 10 else max(2, cold_rounds // 3)):
            remove_db(router.db(host))
            cold_s.append(router.wake_http(host))
            cold_sl.append(router.sleep(host))
        res[mb] = {
            "size": size,
            "seed": seed,
            "seed_sleep": seed_sleep,
            "warm": {"samples": warm_s, "sleeps": warm_sl},
            "cold": {"samples": cold_s, "sleeps": cold_sl},
        }
        log(
            f"{router.name}: {mb} MB warm p50 {ms(statistics.median(s['client'] for s in warm_s))}"
            f", cold p50 {ms(statistics.median(s['client'] for s in cold_s))}"
        )
    return res


# ---------------------------------------------------------------- the capacity run


def capacity_run(router: Router, levels: Sequence[int]) -> dict[str, Any]:
    names = [f"cap{i:03d}.{DOMAIN}" for i in range(1, max(levels) + 1)]
    router.wake_admin(names[0])
    router.sleep(names[0])
    time.sleep(1.0)
    assert router.proc is not None
    rpid = router.proc.pid
    base = {
        "rss": mem_kib(rpid, "Rss"),
        "pss": mem_kib(rpid, "Pss"),
        "fds": fd_kinds(rpid),
        "nofile": nofile_limit(rpid),
    }
    log(f"capacity: router baseline RSS {benchlib.mib(base['rss'])}")
    rows = []
    awake = 0
    for level in levels:
        todo = names[awake:level]
        m0 = wake_metrics(router.sock)
        t = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            lat = list(pool.map(router.wake_admin, todo))
        wall = time.perf_counter() - t
        m1 = wake_metrics(router.sock)
        awake = level
        mean_phase = {
            p: (m1[p][0] - m0[p][0]) / max(1.0, m1[p][1] - m0[p][1]) for p in PHASES if p in m1
        }
        time.sleep(2.0)  # let every initial snapshot settle
        st = router.status()["hosts"]
        pids = [
            st[h]["activator"]["pid"]
            for h in names[:awake]
            if st.get(h, {}).get("state") == "awake"
        ]
        if len(pids) != awake:
            raise RuntimeError(f"{len(pids)} spaces awake, expected {awake}")
        cpu0 = benchlib.cpu_seconds([rpid]), benchlib.cpu_seconds(pids)
        other0 = benchlib.busy_cpu_seconds()
        t0 = time.monotonic()
        time.sleep(5.0)
        span = time.monotonic() - t0
        cpu1 = benchlib.cpu_seconds([rpid]), benchlib.cpu_seconds(pids)
        other = benchlib.busy_cpu_seconds() - other0 - (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
        req = []
        fails = 0
        for h in names[:awake]:
            t = time.perf_counter()
            status, header = through_router(router.port, h, timeout=10)
            req.append(time.perf_counter() - t)
            fails += status != 200 or header is not None  # a wake here means one slept
        rows.append(
            {
                "awake": awake,
                "woken": len(todo),
                "wall": wall,
                "lat": lat,
                "phases": mean_phase,
                "router_fds": fd_kinds(rpid),
                "router_rss": mem_kib(rpid, "Rss"),
                "router_pss": mem_kib(rpid, "Pss"),
                "space_rss": [mem_kib(p, "Rss") for p in pids],
                "space_pss": [mem_kib(p, "Pss") for p in pids],
                "router_cpu": (cpu1[0] - cpu0[0]) / span,
                "space_cpu": (cpu1[1] - cpu0[1]) / span,
                "other_cpu": other / span,
                "req": req,
                "fails": fails,
            }
        )
        log(f"capacity: {awake} awake, router RSS {benchlib.mib(rows[-1]['router_rss'])}")
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(router.sleep, names[:awake]))
    sleep_all = time.perf_counter() - t
    return {"base": base, "rows": rows, "sleep_all": sleep_all, "available": mem_available_kib()}


# ---------------------------------------------------------------- report


def phase_cells(samples: Sequence[dict[str, Any]]) -> list[str]:
    return [ms(statistics.median(s["phases"][p] for s in samples)) for p in PHASES]


def lat_row(label: str, samples: Sequence[dict[str, Any]], sleeps: Sequence[float]) -> list[str]:
    client = [s["client"] for s in samples]
    header = [s["header"] for s in samples]
    return [
        label,
        str(len(client)),
        ms(statistics.median(client)),
        ms(pct(client, 0.99)),
        ms(statistics.median(header)),
        *phase_cells(samples),
        ms(statistics.median(sleeps)) if sleeps else "-",
    ]


def bare_row(label: str, times: Sequence[float], width: int) -> list[str]:
    return [
        label,
        str(len(times)),
        ms(statistics.median(times)),
        ms(pct(times, 0.99)),
        *["-"] * (width - 4),
    ]


def ticks(samples: Sequence[dict[str, Any]], interval: float) -> str:
    """How the ready phases fall on the poll's ticks: '0.4 s x14, 0.6 s x6'."""
    counts: dict[float, int] = {}
    for s in samples:
        tick = round(s["phases"]["ready"] / interval) * interval
        counts[tick] = counts.get(tick, 0) + 1
    return ", ".join(f"{t:.1f} s x{n}" for t, n in sorted(counts.items()))


def report(
    args: argparse.Namespace,
    bare_sized: dict[int, list[float]],
    runs: dict[str, dict[str, Any]],
    cap: dict[str, Any] | None,
    cap_bucket: str,
    mem_start: int,
) -> str:
    out: list[str] = []
    poll, fine, alt = every(args.poll), every(args.fine_poll), every(args.alt_poll)
    out += [
        f"### Wake latency ({args.rounds} warm wakes per bucket; the reference space; loopback)",
        "",
        f"The activator polls a waking space's readiness every **{poll}** (read from "
        "lchat/hibernation/lifecycle.py). client = `GET /api/version` through the router's HTTP port to a "
        "sleeping space, sent to answered; header = the router's `X-Lchat-Wake`; phases = medians "
        "of each wake's `lchat_wake_seconds` deltas; sleep = the `POST /sleep` after it. Bare "
        "start = the space spawned directly, spawn to first 200 on `GET /api/version`, polled "
        f"every {poll} (as the activator) and every {fine} (the space's real start). Per warm "
        f"round: both bare starts, a warm wake, and one on a second router whose poll is patched "
        f"to {alt}, interleaved. p99 of fewer than 100 samples is their maximum.",
        "",
    ]
    head = ["", "n", "client p50", "client p99", "header p50", *PHASES, "sleep p50"]
    w = len(head)
    rows = []
    for bucket, res in runs.items():
        b = res["bare"]
        rows.append(bare_row(f"**{bucket}**: bare start, {poll} poll", b["poll"], w))
        rows.append(bare_row(f"{bucket}: bare start, {fine} poll", b["fine"], w))
        rows.append(lat_row(f"{bucket}: warm wake", res["warm"]["samples"], res["warm"]["sleeps"]))
        if "alt" in res:
            d = res["alt"]
            rows.append(
                lat_row(f"{bucket}: warm wake, poll patched to {alt}", d["samples"], d["sleeps"])
            )
        for mb in args.size_list:
            r = res[mb]
            rows.append(
                lat_row(f"{bucket}: warm wake, {mb} MB", r["warm"]["samples"], r["warm"]["sleeps"])
            )
            rows.append(
                lat_row(f"{bucket}: cold wake, {mb} MB", r["cold"]["samples"], r["cold"]["sleeps"])
            )
            rows.append(
                lat_row(
                    f"{bucket}: first wake, {mb} MB (seeds the bucket)",
                    [r["seed"]],
                    [r["seed_sleep"]],
                )
            )
    for mb, times in bare_sized.items():
        rows.append(bare_row(f"bare start, {mb} MB DB, {fine} poll", times, w))
    out.append(benchlib.table(head, rows))
    if runs:
        first = next(iter(runs.values()))
        sizes = ", ".join(f"{mb} MB = {first[mb]['size'] / 1e6:.1f} MB" for mb in args.size_list)
        if sizes:
            out += ["", f"DB files: {sizes} on disk (random 4000-byte blobs, WAL mode)."]
    out += [""]
    for bucket, res in runs.items():
        line = f"- {bucket}: router CPU per warm wake + sleep {res['warm']['router_cpu'] * 1000:.0f} ms"
        if "alt" in res:
            line += f" ({res['alt']['router_cpu'] * 1000:.0f} ms polling every {alt})"
        for interval, key in ((args.poll, "warm"), (args.alt_poll, "alt")):
            if interval >= 0.1 and key in res:
                line += (
                    f"; polling every {every(interval)}, the ready phase falls on its ticks: "
                    f"{ticks(res[key]['samples'], interval)}"
                )
        out.append(line + ".")

    def mark(ok: bool) -> str:
        return "met" if ok else "**not met**"

    out += ["", "### Goals", ""]
    for bucket, res in runs.items():
        samples = res["warm"]["samples"]
        client = [s["client"] for s in samples]
        polled, polled_fine = res["bare"]["poll"], res["bare"]["fine"]
        warm = statistics.median(client)
        bare, bfine = statistics.median(polled), statistics.median(polled_fine)
        paired = statistics.median(c - b for c, b in zip(client, polled, strict=True))
        own = statistics.median(s["client"] - s["phases"]["ready"] for s in samples)
        ready = statistics.median(s["phases"]["ready"] for s in samples)
        out.append(
            f"- {bucket}: warm wake overhead (wake - bare start, both polled every {poll}) "
            f"≤ 50 ms p50: {mark(warm - bare <= 0.05)} ({ms(warm)} - {ms(bare)} = "
            f"{ms(warm - bare)}; paired median {ms(paired)}). Against the {fine}-polled bare "
            f"start: {ms(warm - bfine)} ({mark(warm - bfine <= 0.05)}): the ready phase exceeds "
            f"the space's own start by {ms(ready - bfine)}, everything outside the ready phase "
            f"(lease, LIST, spawn, replication start, proxying) takes {ms(own)}."
        )
        if 10 in res:
            cold = statistics.median(s["client"] for s in res[10]["cold"]["samples"])
            out.append(
                f"- {bucket}: cold wake 10 MB ≤ 300 ms + bare start: {mark(cold - bare <= 0.3)} "
                f"({ms(cold)} - {ms(bare)} = {ms(cold - bare)}; against the {fine}-polled "
                f"bare start {ms(cold - bfine)})"
            )
        if "alt" in res:
            other = statistics.median(s["client"] for s in res["alt"]["samples"])
            out.append(
                f"- {bucket}, for comparison, poll patched to {alt}: warm wake p50 {ms(other)}, "
                f"{ms(other - bfine)} over the {fine}-polled bare start"
            )
    if cap is not None:
        out += ["", *capacity_report(cap, cap_bucket, mem_start)]
    return "\n".join(out)


def capacity_report(cap: dict[str, Any], bucket: str, mem_start: int) -> list[str]:
    base = cap["base"]
    out = [
        f"### Capacity ({bucket} bucket; idle reference spaces; woken 8 at a time with `POST /wake`)",
        "",
        f"Router baseline (one wake and sleep done, nothing awake): RSS {benchlib.mib(base['rss'])}, "
        f"PSS {benchlib.mib(base['pss'])}, {sum(base['fds'].values())} open fds (open-files limit "
        f"{base['nofile']}: this script raises its soft limit to the hard one, and the router "
        f"inherits that).",
        "",
    ]
    head = [
        "awake",
        "wake p50 / p99 (8 at once)",
        "wakes/s",
        "router RSS",
        "router RSS / space",
        "space RSS (mean)",
        "space PSS (mean)",
        "box PSS / space",
        "router fds",
        "router CPU idle",
        "spaces CPU idle",
        "GET via router p50 / p99",
        "other CPU",
    ]
    rows = []
    for r in cap["rows"]:
        n = r["awake"]
        per_router = (r["router_rss"] - base["rss"]) / n
        box_pss = (r["router_pss"] - base["pss"] + sum(r["space_pss"])) / n
        rows.append(
            [
                str(n),
                f"{ms(statistics.median(r['lat']))} / {ms(pct(r['lat'], 0.99))}",
                f"{r['woken'] / r['wall']:.1f}",
                benchlib.mib(r["router_rss"]),
                f"{per_router:.0f} KiB",
                benchlib.mib(int(statistics.mean(r["space_rss"]))),
                benchlib.mib(int(statistics.mean(r["space_pss"]))),
                benchlib.mib(int(box_pss)),
                str(sum(r["router_fds"].values())),
                f"{r['router_cpu'] * 100:.1f}%",
                f"{r['space_cpu'] * 100:.1f}%",
                f"{ms(statistics.median(r['req']))} / {ms(pct(r['req'], 0.99))}"
                + (f" ({r['fails']} failed)" if r["fails"] else ""),
                f"{r['other_cpu'] * 100:.0f}%",
            ]
        )
    out.append(benchlib.table(head, rows))
    last = cap["rows"][-1]
    n = last["awake"]
    box_pss = (last["router_pss"] - base["pss"] + sum(last["space_pss"])) / n
    router_cpu_each = last["router_cpu"] / n
    space_cpu_each = last["space_cpu"] / n
    by_mem = mem_start / box_pss if box_pss else float("inf")
    cores = os.cpu_count() or 1
    by_router = 1.0 / router_cpu_each if router_cpu_each > 0 else float("inf")
    by_cpu = cores / (router_cpu_each + space_cpu_each) if router_cpu_each + space_cpu_each else 0
    phases = ", ".join(f"{p} {ms(v)}" for p, v in last["phases"].items())
    kinds = sorted(set(last["router_fds"]) | set(base["fds"]))
    fd_each = {k: (last["router_fds"].get(k, 0) - base["fds"].get(k, 0)) / n for k in kinds}
    fd_total = sum(fd_each.values())
    by_fds = (65536 - sum(base["fds"].values())) / fd_total if fd_total > 0 else float("inf")
    out += [
        "",
        f"Mean phases of the last level's wakes: {phases}. Sleeping all {n} took "
        f"{cap['sleep_all']:.1f} s (8 at a time).",
        "",
        f"How many awake (idle) spaces this box holds, extrapolated from {n}: memory "
        f"{mem_start / 1024 / 1024:.1f} GiB available at start ÷ {benchlib.mib(int(box_pss))} PSS "
        f"per space ≈ **{by_mem:,.0f}**; the router's idle CPU ({router_cpu_each * 100:.3f}% of a "
        f"core per awake space) saturates its one core at ≈ {by_router:,.0f}; router + spaces idle "
        f"CPU fill {cores} cores at ≈ {by_cpu:,.0f}; the router's open files "
        f"({fd_total:.1f} per awake space: "
        + ", ".join(f"{k} {v:.1f}" for k, v in fd_each.items() if v)
        + f") reach the unit's LimitNOFILE=65536 (the router raises its soft limit to the hard "
        f"one at start) at ≈ **{by_fds:,.0f}**, before any client connection. The smallest is "
        f"the limit for idle spaces; traffic lowers it.",
    ]
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="warm wakes per bucket")
    parser.add_argument(
        "--cold-rounds", type=int, default=8, help="cold wakes of the 10 MB DB (÷3 above)"
    )
    parser.add_argument("--sizes", default="10,100", help="DB sizes in MB for warm/cold wakes")
    parser.add_argument("--buckets", default="file,moto")
    parser.add_argument("--capacity", default="20,50,100", help="awake-space levels; '' skips")
    parser.add_argument("--fine-poll", type=float, default=0.005, help="seconds")
    parser.add_argument(
        "--alt-poll",
        type=float,
        default=None,
        help="also run warm wakes on a router whose wait_ready interval is patched to this "
        "(default: 0.2, the interval before 4ddcb88, or 0.01 if the activator polls slower; 0 skips)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir and logs")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="run only the memory-limit phase: 0 = the defaults (the box's real limit: heavy), "
        "N = LCHAT_SPACE_MEMORY set so that about N spaces fit (bounded)",
    )
    parser.add_argument(
        "--limit-wakes", type=int, default=20, help="wakes on demand at the limit (--limit)"
    )
    args = parser.parse_args()
    if args.limit is not None:
        limit_main(args)
        return
    args.size_list = [int(s) for s in args.sizes.split(",") if s]
    args.poll = activator_poll()
    if args.alt_poll is None:
        args.alt_poll = 0.2 if args.poll < 0.2 else 0.01
    log(f"the activator polls readiness every {every(args.poll)}")
    buckets = [b for b in args.buckets.split(",") if b]
    levels = sorted(int(k) for k in args.capacity.split(",") if k)
    benchlib.raise_nofile()
    mem_start = mem_available_kib()
    if levels:
        bound = int(mem_start * 0.5 / 1024 / SPACE_MIB_GUESS)
        if levels[-1] > bound:
            log(f"capacity bounded by free memory: at most {bound} spaces")
            levels = [k for k in levels if k < bound] + [bound]
    info = benchlib.machine()

    server = None
    other = OtherCPU([])
    skipped: list[str] = []
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        try:
            base_env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("LCHAT_", "AWS_")) and k != "PYTHONSTARTUP"
            }
            bucket_cfg: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
            if "moto" in buckets:
                try:
                    from tests.s3servers import BIN as MOTO_BIN
                    from tests.s3servers import S3Server

                    if not os.access(os.path.join(MOTO_BIN, "moto_server"), os.X_OK):
                        raise ImportError(f"no moto_server in {MOTO_BIN}")
                except ImportError as e:
                    # bench/run's .venv may lack the test extras: measure what we can.
                    log(f"moto bucket skipped ({e}): /tmp/venv/bin/python has boto3 and moto")
                    buckets.remove("moto")
                    skipped.append(f"moto bucket skipped: {e}")
                else:
                    log("starting moto")
                    server = S3Server("moto")
                    server.start_sync()
            for b in buckets:
                if b == "file":
                    bucket_cfg[b] = ({"LCHAT_HIBERNATE_BUCKET": f"file:{tmp / 'bucket'}"}, base_env)
                elif b == "moto":
                    assert server is not None
                    bucket_cfg[b] = (
                        {
                            "LCHAT_HIBERNATE_BUCKET": server.bucket,
                            "LCHAT_HIBERNATE_ENDPOINT": server.endpoint,
                            "LCHAT_HIBERNATE_REGION": server.region,
                        },
                        {
                            **base_env,
                            "AWS_ACCESS_KEY_ID": server.credentials.access_key,
                            "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
                        },
                    )
                else:
                    sys.exit(f"unknown bucket {b!r}: file or moto")

            other = OtherCPU([server._proc.pid] if server is not None and server._proc else [])
            bare_db = tmp / "bare.db"
            bare_start(tmp, bare_db, args.fine_poll, "warmup")  # creates the DB; not measured

            def bare(interval: float) -> float:
                return bare_start(tmp, bare_db, interval, f"{interval:g}")

            # -- the sized databases, and the space's start on them --------------------------
            other.start()
            sized: dict[int, Path] = {}
            bare_sized: dict[int, list[float]] = {}
            for mb in args.size_list:
                log(f"making a {mb} MB database")
                sized[mb] = tmp / f"sized{mb}.db"
                make_sized_db(sized[mb], mb)
                scratch = tmp / f"bare{mb}.db"
                bare_sized[mb] = []
                for _ in range(3):
                    shutil.copy(sized[mb], scratch)
                    bare_sized[mb].append(bare_start(tmp, scratch, args.fine_poll, f"db{mb}"))
                remove_db(str(scratch))
            other.end("making DBs")

            # -- latency per bucket ---------------------------------------------------------
            runs: dict[str, dict[str, Any]] = {}
            for b in buckets:
                settings, env = bucket_cfg[b]
                router = Router(
                    procs, tmp, f"lat-{b}", {**settings, "LCHAT_HIBERNATE_PREFIX": "lat"}, env
                )
                add_instances(
                    router.env_file,
                    [f"warm.{DOMAIN}", *(f"db{mb}.{DOMAIN}" for mb in args.size_list)],
                )
                alt = None
                if args.alt_poll:
                    alt = Router(
                        procs,
                        tmp,
                        f"poll-{b}",
                        {**settings, "LCHAT_HIBERNATE_PREFIX": "poll"},
                        env,
                        ready_poll=args.alt_poll,
                    )
                    add_instances(alt.env_file, [f"warm.{DOMAIN}"])
                log(f"routers on the {b} bucket")
                other.start()
                router.start()
                try:
                    if alt is not None:
                        alt.start()
                    runs[b] = latency_run(
                        router,
                        sized,
                        args.rounds,
                        args.cold_rounds,
                        bare,
                        args.poll,
                        args.fine_poll,
                        alt,
                    )
                finally:
                    router.stop()
                    if alt is not None:
                        alt.stop()
                other.end(f"{b} wakes")

            # -- capacity -------------------------------------------------------------------
            cap = None
            cap_bucket = "moto" if "moto" in bucket_cfg else (buckets[0] if buckets else "")
            if levels and cap_bucket:
                settings, env = bucket_cfg[cap_bucket]
                router = Router(
                    procs, tmp, "capacity", {**settings, "LCHAT_HIBERNATE_PREFIX": "cap"}, env
                )
                add_instances(
                    router.env_file, [f"cap{i:03d}.{DOMAIN}" for i in range(1, levels[-1] + 1)]
                )
                log(f"capacity on the {cap_bucket} bucket: {levels}")
                other.start()
                router.start()
                try:
                    cap = capacity_run(router, levels)
                finally:
                    router.stop()
                other.end("capacity")
        finally:
            if server is not None:
                server.destroy_sync()

    text = "\n".join(
        [
            "## Wake latency and capacity (`bench/wake.py`)",
            "",
            benchlib.machine_markdown(
                {k: info[k] for k in ("date", "commit", "cpus", "memory", "python", "twisted")}
            ),
            "",
            report(args, bare_sized, runs, cap, cap_bucket, mem_start),
            "",
            *(f"**{note}**\n" for note in skipped),
            "CPU used by other processes on the machine (not this benchmark's), % of one core: "
            + ", ".join(f"{k} {v * 100:.0f}%" for k, v in other.sections.items())
            + ".",
            "",
        ]
    )
    print(text)
    Path("/tmp/wake-section.md").write_text(text)
    log("wrote /tmp/wake-section.md")


# ---------------------------------------------------------------- at the memory limit


def evictions(sock: Path) -> float:
    """``lchat_capacity_evictions_total{reason="memory"}`` from the router's /metrics."""
    status, body = admin(sock, "GET", "/metrics")
    assert status == 200, status
    found = re.search(
        r'lchat_capacity_evictions_total\{reason="memory"\} ([0-9.e+]+)', body.decode()
    )
    return float(found.group(1)) if found else 0.0


def awake_count(router: Router) -> int:
    return sum(1 for h in router.status()["hosts"].values() if h.get("state") == "awake")


def limit_run(router: Router, names: Sequence[str], at_limit: int) -> dict[str, Any]:
    """Wake ``names`` 8 at a time with ``POST /wake`` until a wake first sleeps another for memory
    (the box is full: the count awake then is what it holds), then ``at_limit`` more one at a time
    (each sleeps the idle-longest space, then wakes): their latency is a wake on demand at the
    limit. No cap is set but what the run's settings say (the defaults: none)."""
    ev0 = evictions(router.sock)
    fill: list[float] = []
    woken = 0
    t = time.perf_counter()
    while woken < len(names) - at_limit:
        batch = names[woken : woken + 8]
        with ThreadPoolExecutor(8) as pool:
            fill += pool.map(router.wake_admin, batch)
        woken += len(batch)
        if evictions(router.sock) > ev0:
            break
    fill_wall = time.perf_counter() - t
    if evictions(router.sock) == ev0:
        raise RuntimeError(f"{woken} woken and no wake needed room: register more names")
    held = awake_count(router)
    log(f"limit: {held} awake when memory first needed room ({woken} woken)")
    lat = []
    for host in names[woken : woken + at_limit]:
        lat.append(router.wake_admin(host))
    capacity = router.status()["capacity"]
    return {
        "held": held,
        "woken": woken,
        "fill": fill,
        "fill_wall": fill_wall,
        "lat": lat,
        "held_after": awake_count(router),
        "evicted": evictions(router.sock) - ev0,
        "capacity": capacity,
    }


def limit_report(res: dict[str, Any], settings: dict[str, str], mem_start: int) -> list[str]:
    cap = res["capacity"]
    lat = res["lat"]
    shown = ", ".join(f"`{k}={v}`" for k, v in settings.items()) or "none (the defaults)"
    return [
        "### Awake spaces held, and a wake on demand at the memory limit",
        "",
        f"Capacity settings: {shown}. Available memory at start {benchlib.mib(mem_start)}. Idle "
        f"reference spaces woken 8 at a time (`POST /wake`) until a wake first slept another for "
        f"memory; then {len(lat)} wakes one at a time, each sleeping the idle-longest space first.",
        "",
        benchlib.table(
            [
                "held awake",
                "woken to get there",
                "fill wakes/s",
                "wake at the limit p50 / p99",
                "awake after",
                "evicted (memory)",
                "per-space figure",
                "reserve",
                "router's estimate",
            ],
            [
                [
                    str(res["held"]),
                    str(res["woken"]),
                    f"{len(res['fill']) / res['fill_wall']:.1f}",
                    f"{ms(statistics.median(lat))} / {ms(pct(lat, 0.99))}",
                    str(res["held_after"]),
                    f"{res['evicted']:g}",
                    benchlib.mib(cap.get("per_space", 0) // 1024),
                    benchlib.mib(cap.get("mem_reserve", 0) // 1024),
                    str(cap.get("awake_estimate", "-")),
                ]
            ],
        ),
        "",
    ]


def limit_main(args: argparse.Namespace) -> None:
    """``--limit N``: the memory-limit run alone, on a ``file:`` bucket. N = 0: the defaults
    (no figure: the box's real limit, ~700 reference spaces on 24 GB: a heavy run); N > 0:
    ``LCHAT_SPACE_MEMORY`` set so that about N fit in the memory available now (bounded)."""
    from lchat.hibernation.capacity import Memory, proc_readers

    benchlib.raise_nofile()
    mem_start = mem_available_kib()
    here = Memory(proc_readers())
    settings: dict[str, str] = {}
    if args.limit > 0:
        figure = int((here.available() - here.reserve()) / (args.limit + 0.5))
        settings["LCHAT_SPACE_MEMORY"] = str(figure)
        count = args.limit + args.limit_wakes + 24
    else:
        count = int((here.available() - here.reserve()) / (30 << 20)) + args.limit_wakes + 64
    info = benchlib.machine()
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("LCHAT_", "AWS_")) and k != "PYTHONSTARTUP"
        }
        bucket = {"LCHAT_HIBERNATE_BUCKET": f"file:{tmp / 'bucket'}", **settings}
        # A row ceiling, not a process cap: lifted so this many can be registered on one box.
        router = Router(procs, tmp, "limit", {**bucket, "LCHAT_MAX_REGISTERED": "0"}, env)
        names = [f"lim{i:04d}.{DOMAIN}" for i in range(count)]
        add_instances(router.env_file, names)
        log(f"limit run: {count} registered, settings {settings or 'defaults'}")
        router.start()
        try:
            res = limit_run(router, names, args.limit_wakes)
        finally:
            router.stop()
    text = "\n".join(
        [
            benchlib.machine_markdown(
                {k: info[k] for k in ("date", "commit", "cpus", "memory", "python", "twisted")}
            ),
            "",
            *limit_report(res, settings, mem_start),
        ]
    )
    print(text)
    Path("/tmp/wake-limit-section.md").write_text(text)
    log("wrote /tmp/wake-limit-section.md")


def child_router(argv: list[str]) -> None:
    """``twistd`` with ``RunningChild.wait_ready``'s interval replaced (the router process only;
    lchat's files are untouched): what the wake would cost with a finer readiness poll."""
    # The router's reactor first: nothing imported below may install twistd's default.
    benchlib.install_router_reactor()
    from lchat import child

    interval = float(argv[0])
    original = child.RunningChild.wait_ready

    def wait_ready(self: Any, timeout: float = 30.0, **_: Any) -> Any:
        return original(self, timeout, interval)

    child.RunningChild.wait_ready = wait_ready  # type: ignore[method-assign]
    from twisted.scripts.twistd import run

    sys.argv = ["twistd", *argv[1:]]
    run()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-router"]:
        child_router(sys.argv[2:])
    else:
        main()

"""ACME issuance: how long a new host waits for its first certificate from the router, beside
certbot on the same CA (Pebble), the same machine, the same run.

    .venv/bin/python bench/issuance.py [--hosts 20] [--concurrent 50] [--breakdown 5] [--shared 5]
        [--poll 0.02] [--fine-poll 0.005] [--certbot PATH] [--keep]

(~2 min with the defaults on 2 cores, ~10 s of it installing certbot. The shared-cache part
needs the test extras — boto3, moto — as tests/s3servers.py does; `make install` puts them in
.venv. Without them it is skipped, and said so.) Prints a Markdown section and writes it to
/tmp/acme-section.md.

What runs: tests/acmeservers.py's harness: one pebble-challtestsrv (every name resolves to
127.0.0.1) and two Pebbles using it, with ``PEBBLE_VA_NOSLEEP=1`` (validation at once) and
``PEBBLE_AUTHZREUSE=0`` (every order validated afresh); each Pebble validates HTTP-01 on a port of
its own, so the router and certbot never compete for one and can be measured interleaved.

- **lchat**: ``twistd -n --pidfile= lchat --env-file <tmp>/<name>.env`` with
  ``LCHAT_ACME_DIRECTORY`` and ``LCHAT_ACME_CA_FILE`` of the first Pebble, ``LCHAT_HTTP_ADDR`` on
  the port that Pebble validates on (127.0.0.1), ``LCHAT_HTTPS_ADDR`` on a free port, no
  ``default.pem``, and the hosts registered as ``ready`` services in its registry (written here
  before it starts, as tests/test_acme.py does). Per host, one at a time: a TLS handshake with SNI
  (it fails at once: nothing to serve; the issuer starts an order), then one every ``--poll`` until
  a certificate verifying against Pebble's root (and the host name) is served. Time = first
  handshake sent to the verified handshake done.
- **certbot** (the anchor): ``certbot certonly --standalone --http-01-port <the second Pebble's
  port> --http-01-address 127.0.0.1 --server <its directory> -d <host> --non-interactive
  --agree-tos --register-unsafely-without-email --config-dir/--work-dir/--logs-dir <tmp>`` with
  ``REQUESTS_CA_BUNDLE=<its API CA>``, one process per host, one config dir for all (so, as for the
  router, only the first host registers an account). Time = spawn to exit (the certificate is on
  disk then, verified here against Pebble's intermediate; no server is serving it yet). Beside it,
  ``certbot --version`` (process start: Python, imports) once per round. certbot comes from
  ``--certbot``, else the running Python if it can import it, else a throwaway venv in the temp
  dir (``pip install certbot``: PyPI), removed at the end; never the project's venv.
- Rounds interleave: round i issues host i with lchat and with certbot (alternating which goes
  first) and times ``certbot --version``, so drift on the machine hits both.
- **concurrency**: ``--concurrent`` clients start their first handshake for one new host at once
  (a barrier), each then polls every ``--poll``: the orders placed (``lchat_acme_orders_total``
  from the router's ``/metrics`` on its admin socket, before and after) and the time until every
  client got the certificate.
- **breakdown**: a second router whose process wraps the issuer's steps with timestamps (this
  script's ``--child-router``, in that process only; lchat's files are untouched), ``--breakdown``
  hosts one at a time; certbot's from its own debug log (``letsencrypt.log``, millisecond
  timestamps) of every round. Medians per phase.
- **shared cache** (``--shared`` hosts): a moto server (tests/s3servers.py), two routers (A on
  127.0.0.1, which Pebble validates at, B on 127.0.0.2) with ``LCHAT_CERT_CACHE=s3``, one key,
  one bucket. Per host: A's first certificate (as above; its order takes the bucket's issuance lock
  and uploads), then B's first handshake for it, polled every ``--fine-poll``, until B serves the
  same serial: the first-contact path (a bucket GET, install, rescan). B's ``LCHAT_CERT_CACHE_SYNC`` is 1h so that its periodic
  sync cannot install it first; A's is 1s.

Everything listens on loopback; every process is in its own process group, killed at the end.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib
from benchlib import BIN, ROOT, Processes, log
from cryptography import x509

DOMAIN = "bench.test"
METRIC = re.compile(r"^(lchat_[a-z_]+)\{([^}]*)\} (\S+)$", re.M)
CERTBOT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):(\w+):([\w.]+):(.*)$")
# certbot's log lines that end its phases (the first match of each after the previous one)
CERTBOT_MARKS = (
    ("requesting", "Requesting a certificate for"),
    ("answered", "Waiting for verification"),
    ("validated", "Cleaning up challenges"),
    ("finalize", "finalize-order"),
    ("written", "Writing certificate to"),
)


# ---------------------------------------------------------------- small pieces


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.0f} ms"


def secs(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds:.2f} s"


def ratio(a: float, b: float) -> str:
    if a != a or b != b or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without LCHAT_*, AWS_*, proxies (loopback only) and PEBBLE_*."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LCHAT_", "AWS_", "PEBBLE_", "REQUESTS_CA_BUNDLE"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
        and k != "PYTHONSTARTUP"
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra or {})
    return env


class OtherCPU:
    """CPU the machine spent on processes that are not ours, per section (% of one core)."""

    def __init__(self) -> None:
        self.live: list[Callable[[], list[int]]] = []  # pids of our long-lived processes
        self.sections: dict[str, float] = {}
        self._mark: tuple[float, float, float] | None = None

    def _ours(self) -> float:
        pids = [p for f in self.live for p in f()]
        return benchlib.own_cpu_seconds() + sum(benchlib.tree_cpu(p) for p in pids)

    def start(self) -> None:
        self._mark = (time.monotonic(), benchlib.busy_cpu_seconds(), self._ours())

    def end(self, name: str) -> None:
        assert self._mark is not None
        t, busy, ours = self._mark
        other = benchlib.busy_cpu_seconds() - busy - (self._ours() - ours)
        self.sections[name] = max(0.0, other) / max(time.monotonic() - t, 1e-9)


# ---------------------------------------------------------------- TLS clients


def tls_context(roots: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=roots)  # verifies the chain and the host name


def handshake(
    context: ssl.SSLContext, address: str, port: int, host: str
) -> x509.Certificate | str:
    """One TLS handshake: the verified leaf, or why it failed."""
    try:
        with (
            socket.create_connection((address, port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=host) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der)
    except (ssl.SSLError, OSError) as e:
        return f"{type(e).__name__}: {e}"


@dataclass
class Served:
    host: str
    t0: float  # first handshake sent (time.time())
    t1: float  # verified handshake done
    tries: int
    serial: int

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def until_served(
    context: ssl.SSLContext,
    address: str,
    port: int,
    host: str,
    poll: float,
    timeout: float = 90.0,
    start: threading.Barrier | None = None,
) -> Served:
    """Handshake at once, then every ``poll`` s, until a verified certificate is served."""
    if start is not None:
        start.wait()
    t0 = time.time()
    next_at, tries, last = t0, 0, ""
    while True:
        tries += 1
        got = handshake(context, address, port, host)
        now = time.time()
        if isinstance(got, x509.Certificate):
            return Served(host, t0, now, tries, got.serial_number)
        last = got
        if now - t0 > timeout:
            raise RuntimeError(f"{host}: no verified certificate after {timeout:g}s: {last}")
        next_at += poll
        if next_at > now:
            time.sleep(next_at - now)
        else:
            next_at = now


# ---------------------------------------------------------------- processes


def run_group(
    argv: Sequence[str], env: dict[str, str], out: Path, timeout: float = 120.0
) -> tuple[int, float, float]:
    """Run ``argv`` in its own session (killed with its group if we stop): (rc, t0, t1)."""
    with open(out, "ab") as f:
        t0 = time.time()
        proc = subprocess.Popen(
            list(argv),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=benchlib._die_with_parent,
        )
        try:
            rc = proc.wait(timeout=timeout)
            t1 = time.time()
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, t0, t1


class Router:
    """One ``twistd -n lchat`` with its own env file, data dir, run dir and registry."""

    def __init__(
        self,
        procs: Processes,
        tmp: Path,
        name: str,
        settings: dict[str, str],
        env: dict[str, str],
        address: str = "127.0.0.1",
        events: Path | None = None,
    ) -> None:
        from lchat.registry import Registry

        self.procs, self.name, self.env, self.address = procs, name, env, address
        self.events = events
        self.data, self.run = tmp / f"{name}-data", tmp / f"{name}-run"
        self.data.mkdir()
        self.run.mkdir()
        self.https_port = benchlib.free_port()
        self.env_file = tmp / f"{name}.env"
        lines = [
            f"LCHAT_DATA_DIR={self.data}",
            f"LCHAT_RUN_DIR={self.run}",
            f"LCHAT_HTTPS_ADDR=tcp:{self.https_port}:interface={address}",
            "LCHAT_UNITS=builtin",
            # One process, as the figures' history (the default is one per core).
            "LCHAT_WORKERS=1",
            *(f"{k}={v}" for k, v in settings.items()),
            "",
        ]
        self.env_file.write_text("\n".join(lines))
        self.sock = self.run / "router.sock"
        self.registry = Registry(str(self.data / "registry.db"), time.time)
        self.registry.migrate()
        self.proc: subprocess.Popen[bytes] | None = None

    def register(self, hosts_: Sequence[str]) -> None:
        from lchat.registry import Route

        for host in hosts_:
            self.registry.insert(
                Route(host=host, kind="service", socket=str(self.run / "svc.sock"), status="ready")
            )

    def start(self) -> None:
        twistd = [str(BIN / "twistd")]
        if self.events is not None:
            twistd = [sys.executable, os.path.abspath(__file__), "--child-router", str(self.events)]
        self.proc = self.procs.start(
            self.name,
            [*twistd, "-n", "--pidfile=", "lchat", "--env-file", str(self.env_file)],
            env=self.env,
        )

        def up() -> bool:
            try:
                return benchlib.admin(self.sock, "GET", "/status", timeout=2)[0] == 200
            except OSError:
                return False

        try:
            benchlib.wait_until(up, 30, f"router {self.name}", self.procs)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.procs.tail(self.name)}") from None

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []

    def stop(self) -> None:
        self.procs.stop(self.proc, timeout=30)

    def metrics(self) -> dict[tuple[str, str], float]:
        status, body = benchlib.admin(self.sock, "GET", "/metrics")
        assert status == 200, status
        return {(m, labels): float(v) for m, labels, v in METRIC.findall(body.decode())}

    def orders(self) -> float:
        return self.metrics().get(("lchat_acme_orders_total", 'type="host"'), 0.0)

    def until_served(self, context: ssl.SSLContext, host: str, poll: float) -> Served:
        return until_served(context, self.address, self.https_port, host, poll)


# ---------------------------------------------------------------- certbot


def find_certbot(args: argparse.Namespace, tmp: Path) -> list[str]:
    if args.certbot:
        return [args.certbot]
    if importlib.util.find_spec("certbot") is not None:
        return [sys.executable, "-m", "certbot"]
    venv = tmp / "certbot-venv"
    log(f"installing certbot from PyPI into a throwaway venv ({venv})")
    with open(tmp / "certbot-install.log", "wb") as out:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "certbot"],
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return [str(venv / "bin" / "certbot")]


@dataclass
class CertbotRun:
    host: str
    seconds: float
    phases: dict[str, float]  # phase -> seconds


class Certbot:
    def __init__(self, argv: list[str], tmp: Path, pebble: Any, intermediate: str) -> None:
        self.argv, self.pebble = argv, pebble
        self.dir = tmp / "certbot"
        self.dirs = {k: self.dir / k for k in ("config", "work", "logs")}
        for d in self.dirs.values():
            d.mkdir(parents=True)
        self.env = child_env({"REQUESTS_CA_BUNDLE": pebble.ca_file})
        self.out = tmp / "certbot.log"
        self.intermediate = x509.load_pem_x509_certificate(intermediate.encode())

    def version(self) -> tuple[str, float]:
        rc, t0, t1 = run_group([*self.argv, "--version"], self.env, self.out, timeout=60)
        if rc != 0:
            raise RuntimeError(f"certbot --version exited {rc}: see {self.out}")
        return self.out.read_text().strip().splitlines()[-1], t1 - t0

    def issue(self, host: str) -> CertbotRun:
        argv = [
            *self.argv,
            "certonly",
            "--standalone",
            "--http-01-port",
            str(self.pebble.http_port),
            "--http-01-address",
            "127.0.0.1",
            "--server",
            self.pebble.directory_url,
            "-d",
            host,
            "--non-interactive",
            "--agree-tos",
            "--register-unsafely-without-email",
            "--config-dir",
            str(self.dirs["config"]),
            "--work-dir",
            str(self.dirs["work"]),
            "--logs-dir",
            str(self.dirs["logs"]),
        ]
        rc, t0, t1 = run_group(argv, self.env, self.out)
        if rc != 0:
            tail = "\n".join(self.out.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"certbot for {host} exited {rc}:\n{tail}")
        chain = (self.dirs["config"] / "live" / host / "fullchain.pem").read_bytes()
        leaf = x509.load_pem_x509_certificates(chain)[0]
        leaf.verify_directly_issued_by(self.intermediate)  # Pebble's, this run's
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [host], names
        return CertbotRun(host, t1 - t0, self._phases(t0, t1))

    def _phases(self, t0: float, t1: float) -> dict[str, float]:
        """certbot's own log of this run (the current letsencrypt.log): its milestones."""
        import datetime

        stamps: list[tuple[float, str]] = []
        text = (self.dirs["logs"] / "letsencrypt.log").read_text(errors="replace")
        for line in text.splitlines():
            m = CERTBOT_LINE.match(line)
            if m:
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                stamps.append((when, m.group(4)))
        if not stamps:
            return {}
        marks = {"spawn": t0, "first log line": stamps[0][0]}
        i = 0
        for key, needle in CERTBOT_MARKS:
            while i < len(stamps) and needle not in stamps[i][1]:
                i += 1
            if i == len(stamps):
                return {}
            marks[key] = stamps[i][0]
        marks["exit"] = t1
        return {
            "start": marks["first log line"] - t0,
            "to answered": marks["answered"] - marks["first log line"],
            "account": marks["requesting"] - marks["first log line"],
            "validation wait": marks["validated"] - marks["answered"],
            "to finalize": marks["finalize"] - marks["validated"],
            "finalize to cert": marks["written"] - marks["finalize"],
            "store, serve": t1 - marks["written"],
        }


# ---------------------------------------------------------------- the instrumented router


def child_router(argv: list[str]) -> None:
    """``twistd`` with the issuer's steps timestamped into ``argv[0]`` (one JSON line each, on
    ``time.time()``): this process only, lchat's files are untouched."""
    import functools

    # The router's reactor first: nothing imported below may install twistd's default.
    benchlib.install_router_reactor()
    from acme import client as acme_client

    from lchat import tls
    from lchat.acme import cache, http01, issuer
    from lchat.acme import client as lchat_client

    out = open(argv[0], "a", buffering=1)  # open for the process's lifetime
    lock = threading.Lock()
    local = threading.local()

    def emit(name: str, event: str, **extra: Any) -> None:
        line = json.dumps({"t": time.time(), "name": name, "event": event, **extra})
        with lock:
            out.write(line + "\n")

    def timed(cls: Any, attr: str, label: str, name_of: Callable[..., str]) -> None:
        original = getattr(cls, attr)

        @functools.wraps(original)
        def wrapper(*a: Any, **kw: Any) -> Any:
            name = name_of(*a, **kw)
            emit(name, label + ":begin")
            try:
                result = original(*a, **kw)
            except BaseException:
                emit(name, label + ":end")
                raise
            # An ACME resource's status as the CA answered (e.g. the finalize POST's order).
            status = getattr(getattr(result, "body", None), "status", None)
            extra = {} if status is None else {"status": getattr(status, "name", str(status))}
            emit(name, label + ":end", **extra)
            return result

        setattr(cls, attr, wrapper)

    def timed_async(cls: Any, attr: str, label: str, name_of: Callable[..., str]) -> None:
        original = getattr(cls, attr)

        @functools.wraps(original)
        async def wrapper(*a: Any, **kw: Any) -> Any:
            name = name_of(*a, **kw)
            emit(name, label + ":begin")
            try:
                return await original(*a, **kw)
            finally:
                emit(name, label + ":end")

        setattr(cls, attr, wrapper)

    def current(*a: Any, **kw: Any) -> str:
        return getattr(local, "name", "?")

    # Reactor side: asked (the SNI callback's start), the order coroutine, the install.
    original_start = issuer.Issuer.start

    def start(self: Any, name: Any, reason: str) -> Any:
        if name not in self._inflight:
            emit(name.label, "asked", reason=reason)
        return original_start(self, name, reason)

    issuer.Issuer.start = start  # type: ignore[method-assign]
    timed_async(issuer.Issuer, "_order", "order", lambda self, name, reason: name.label)
    timed_async(issuer.Issuer, "_install", "install", lambda self, name, cert: name.label)
    timed(cache.LocalCache, "install", "write", lambda self, name, cert: name.label)
    original_rescan = tls.CertStore.rescan

    def rescan(self: Any) -> Any:
        emit("*", "rescan:begin")
        d = original_rescan(self)
        d.addBoth(lambda r: (emit("*", "rescan:end"), r)[1])
        return d

    tls.CertStore.rescan = rescan  # type: ignore[method-assign]

    # The order's thread: lchat's AcmeAccount, and the acme library's calls within it.
    original_issue = lchat_client.AcmeAccount.issue

    def issue(self: Any, names: Any, solver: Any, **kw: Any) -> Any:
        local.name = names[0]
        emit(local.name, "issue:begin")
        try:
            return original_issue(self, names, solver, **kw)
        finally:
            emit(local.name, "issue:end")

    lchat_client.AcmeAccount.issue = issue  # type: ignore[method-assign]
    timed(lchat_client.AcmeAccount, "connect", "connect", current)
    timed(lchat_client.AcmeAccount, "_wait_validated", "wait_validated", current)
    timed(lchat_client.AcmeAccount, "_finalize", "finalize", current)
    for attr in (
        "new_order",
        "answer_challenge",
        "poll",
        "poll_authorizations",
        "begin_finalization",
    ):
        timed(acme_client.ClientV2, attr, attr, current)

    original_answer = http01._Challenge._answer

    def answer(self: Any, request: Any, token: str, value: str) -> bytes:
        host = (request.getHeader(b"host") or b"?").decode("ascii", "replace").split(":")[0]
        emit(host, "challenge_fetched")
        result: bytes = original_answer(self, request, token, value)
        return result

    http01._Challenge._answer = answer  # type: ignore[method-assign]

    from twisted.scripts.twistd import run

    sys.argv = ["twistd", *argv[1:]]
    run()


@dataclass
class Timeline:
    """One host's events from the instrumented router, beside the client's times."""

    served: Served
    first: dict[str, float] = field(default_factory=dict)  # event -> first time
    last: dict[str, float] = field(default_factory=dict)  # event -> last time
    count: dict[str, int] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)  # event -> the CA's last status

    def add(self, event: str, t: float) -> None:
        self.first.setdefault(event, t)
        self.last[event] = t
        self.count[event] = self.count.get(event, 0) + 1

    def phases(self) -> dict[str, float]:
        f, la, s = self.first, self.last, self.served
        return {
            "start": f["issue:begin"] - s.t0,
            "account": f["connect:end"] - f["connect:begin"],
            "to answered": la["answer_challenge:end"] - f["issue:begin"],
            "ca fetch": f["challenge_fetched"] - f["answer_challenge:begin"],
            "validation wait": la["wait_validated:end"] - la["answer_challenge:end"],
            "to finalize": f["begin_finalization:begin"] - la["wait_validated:end"],
            "finalize to cert": la["finalize:end"] - f["begin_finalization:begin"],
            "finalize post": la["begin_finalization:end"] - f["begin_finalization:begin"],
            "store, serve": s.t1 - la["finalize:end"],
            "write": la["write:end"] - f["write:begin"],
            "rescan": la["rescan:end"] - f["rescan:begin"],
            "client poll": s.t1 - la["install:end"],
            "polls": float(self.count.get("poll:end", 0)),
        }


def read_timelines(events: Path, served: Sequence[Served]) -> list[Timeline]:
    by_host = {s.host: Timeline(s) for s in served}
    rescans: list[tuple[float, str]] = []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e["name"] == "*":
            rescans.append((e["t"], e["event"]))
        elif e["name"] in by_host:
            by_host[e["name"]].add(e["event"], e["t"])
            if "status" in e:
                by_host[e["name"]].status[e["event"]] = e["status"]
    # A rescan belongs to the install it ran inside (one host at a time here).
    for tl in by_host.values():
        lo, hi = tl.first.get("write:end", 0.0), tl.last.get("install:end", 0.0)
        for t, event in rescans:
            if lo <= t <= hi:
                tl.add(event, t)
    return list(by_host.values())


# ---------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=20, help="hosts per side, one at a time")
    parser.add_argument("--concurrent", type=int, default=50, help="clients for one new host")
    parser.add_argument("--breakdown", type=int, default=5, help="hosts on the timed router")
    parser.add_argument("--shared", type=int, default=5, help="hosts through the shared cache")
    parser.add_argument("--poll", type=float, default=0.02, help="handshake poll, seconds")
    parser.add_argument(
        "--fine-poll",
        type=float,
        default=0.005,
        help="handshake poll for box B's first contact with the shared cache, seconds",
    )
    parser.add_argument("--certbot", help="a certbot executable (else installed in a venv)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    began = time.monotonic()
    info = benchlib.machine()
    from tests import acmeservers

    benchlib.ensure_tools(["pebble"])  # Debian's: pebble and pebble-challtestsrv
    other = OtherCPU()
    results: dict[str, Any] = {"skipped": []}
    servers: list[Any] = []
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        try:
            certbot_argv = find_certbot(args, tmp)
            from tests.s3servers import free_ports

            log("starting pebble-challtestsrv and two Pebbles")
            dns = acmeservers.ChallTestSrv("127.0.0.1")
            servers.append(dns)
            dns.start_sync()
            port_l, port_c = free_ports(2)
            pebble_l = acmeservers.Pebble(port_l, dns)
            servers.append(pebble_l)
            pebble_c = acmeservers.Pebble(port_c, dns)
            servers.append(pebble_c)
            pebble_l.start_sync()
            pebble_c.start_sync()
            other.live.append(lambda: [s._proc.pid for s in servers if s._proc is not None])
            roots_l = tmp / "roots-lchat.pem"
            roots_l.write_text(pebble_l.roots_pem())
            ctx_l = tls_context(str(roots_l))
            certbot = Certbot(certbot_argv, tmp, pebble_c, pebble_c.intermediates_pem())
            results["certbot_version"] = certbot.version()[0]
            results["acme_version"] = importlib.metadata.version("acme")
            acme_settings = {
                "LCHAT_ACME_DIRECTORY": pebble_l.directory_url,
                "LCHAT_ACME_CA_FILE": pebble_l.ca_file,
                "LCHAT_HTTP_ADDR": f"127.0.0.1:{port_l}",
            }
            env = child_env()

            # -- 1, 2: one host at a time, lchat and certbot interleaved --------------------
            router = Router(procs, tmp, "router", acme_settings, env)
            other.live.append(router.pids)
            hosts_l = [f"h{i:02d}.lchat.{DOMAIN}" for i in range(args.hosts)]
            storm = f"storm.lchat.{DOMAIN}"
            router.register([*hosts_l, storm])
            router.start()
            log(f"{args.hosts} hosts each: lchat (HTTP-01 on first contact) and certbot")
            lchat_runs: list[Served] = []
            certbot_runs: list[CertbotRun] = []
            starts: list[float] = []
            other.start()
            for i in range(args.hosts):
                host_c = f"h{i:02d}.certbot.{DOMAIN}"
                steps: list[Callable[[], None]] = [
                    lambda i=i: lchat_runs.append(
                        router.until_served(ctx_l, hosts_l[i], args.poll)
                    ),
                    lambda h=host_c: certbot_runs.append(certbot.issue(h)),
                ]
                for step in steps if i % 2 == 0 else reversed(steps):
                    step()
                starts.append(certbot.version()[1])
                log(
                    f"  {i + 1}/{args.hosts}: lchat {ms(lchat_runs[-1].seconds)}, certbot "
                    f"{ms(certbot_runs[-1].seconds)} (start {ms(starts[-1])})"
                )
            other.end("one at a time")
            orders = router.orders()
            if orders != args.hosts:
                raise RuntimeError(f"{orders:g} orders for {args.hosts} hosts")
            results.update(lchat=lchat_runs, certbot=certbot_runs, starts=starts)

            # -- 3: concurrent first handshakes for one host --------------------------------
            if args.concurrent > 0:
                log(f"{args.concurrent} concurrent first handshakes for {storm}")
                before = router.metrics()
                barrier = threading.Barrier(args.concurrent)
                other.start()
                with ThreadPoolExecutor(args.concurrent) as pool:
                    futures = [
                        pool.submit(
                            until_served,
                            ctx_l,
                            "127.0.0.1",
                            router.https_port,
                            storm,
                            args.poll,
                            90.0,
                            barrier,
                        )
                        for _ in range(args.concurrent)
                    ]
                    storm_runs = [f.result() for f in futures]
                other.end("concurrent")
                after = router.metrics()
                key = ("lchat_acme_orders_total", 'type="host"')
                fails = ("lchat_tls_handshake_failures_total", 'reason="no_certificate"')
                results["storm"] = {
                    "runs": storm_runs,
                    "orders": after.get(key, 0.0) - before.get(key, 0.0),
                    "failed": after.get(fails, 0.0) - before.get(fails, 0.0),
                    "serials": len({r.serial for r in storm_runs}),
                }
            router.stop()

            # -- breakdown: the same on a router that timestamps its steps ------------------
            if args.breakdown > 0:
                log(f"breakdown: {args.breakdown} hosts on a timed router")
                events = tmp / "events.jsonl"
                timed_router = Router(procs, tmp, "timed", acme_settings, env, events=events)
                other.live.append(timed_router.pids)
                hosts_t = [f"t{i:02d}.lchat.{DOMAIN}" for i in range(args.breakdown)]
                timed_router.register(hosts_t)
                timed_router.start()
                other.start()
                served = [timed_router.until_served(ctx_l, h, args.poll) for h in hosts_t]
                other.end("breakdown")
                timed_router.stop()
                results["timelines"] = read_timelines(events, served)

            # -- 4: the shared cache --------------------------------------------------------
            if args.shared > 0:
                results["shared"] = shared_run(args, tmp, procs, acme_settings, ctx_l, other)
                if isinstance(results["shared"], str):
                    results["skipped"].append(results["shared"])
                    results["shared"] = None
        finally:
            for server in reversed(servers):
                with contextlib.suppress(Exception):
                    server.destroy_sync()

    results["other"] = other.sections
    results["run_time"] = time.monotonic() - began
    text = report(args, info, results)
    print(text)
    Path("/tmp/acme-section.md").write_text(text)
    log("wrote /tmp/acme-section.md")


def shared_run(
    args: argparse.Namespace,
    tmp: Path,
    procs: Processes,
    acme_settings: dict[str, str],
    ctx: ssl.SSLContext,
    other: OtherCPU,
) -> dict[str, Any] | str:
    try:
        from tests.s3servers import BIN as MOTO_BIN
        from tests.s3servers import S3Server

        if not os.access(os.path.join(MOTO_BIN, "moto_server"), os.X_OK):
            raise ImportError(f"no moto_server in {MOTO_BIN}")
    except ImportError as e:
        log(f"shared cache skipped ({e})")
        return f"shared cache skipped: {e}"
    log(f"shared cache: moto, two routers, {args.shared} hosts")
    server = S3Server("moto")
    try:
        server.start_sync()
        other.live.append(lambda: [server._proc.pid] if server._proc is not None else [])
        bucket = server.new_bucket_sync()
        key = base64.b64encode(secrets.token_bytes(32)).decode()
        env = child_env(
            {
                "AWS_ACCESS_KEY_ID": server.credentials.access_key,
                "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
            }
        )
        http_port = acme_settings["LCHAT_HTTP_ADDR"].rsplit(":", 1)[1]
        common = {
            **acme_settings,
            "LCHAT_HIBERNATE_BUCKET": bucket,
            "LCHAT_HIBERNATE_ENDPOINT": server.endpoint,
            "LCHAT_HIBERNATE_REGION": server.region,
            "LCHAT_HIBERNATE_PREFIX": "bench",
            "LCHAT_CERT_CACHE": "s3",
            "LCHAT_CERT_CACHE_KEY": key,
        }
        a = Router(
            procs,
            tmp,
            "shared-a",
            {**common, "LCHAT_CERT_CACHE_SYNC": "1s"},
            env,
        )
        b = Router(
            procs,
            tmp,
            "shared-b",
            {
                **common,
                "LCHAT_HTTP_ADDR": f"127.0.0.2:{http_port}",
                "LCHAT_CERT_CACHE_SYNC": "1h",
            },
            env,
            address="127.0.0.2",
        )
        hosts_s = [f"s{i:02d}.lchat.{DOMAIN}" for i in range(args.shared)]
        for box in (a, b):
            other.live.append(box.pids)
            box.register(hosts_s)
            box.start()
        time.sleep(1.0)  # both boxes' first sync and bucket probe are done
        first_a: list[Served] = []
        first_b: list[Served] = []
        other.start()
        for host in hosts_s:
            first_a.append(a.until_served(ctx, host, args.poll))
            first_b.append(b.until_served(ctx, host, args.fine_poll))
            if first_b[-1].serial != first_a[-1].serial:
                raise RuntimeError(f"{host}: B serves another certificate than A")
        other.end("shared cache")
        got = {
            "a": first_a,
            "b": first_b,
            "orders_a": a.orders(),
            "orders_b": b.orders(),
            "shared_b": b.metrics().get(
                ("lchat_acme_issuances_total", 'outcome="shared",type="host"'), 0.0
            ),
        }
        a.stop()
        b.stop()
        return got
    finally:
        server.destroy_sync()


# ---------------------------------------------------------------- the report


PHASES = (
    # key, what lchat does there, what certbot does there
    ("start", "handshake → order thread runs", "spawn → first log line (Python, imports)"),
    ("to answered", "account, key, CSR, new order, authz, answer", "the same (+ bind port 80)"),
    ("validation wait", "answered → authz valid", "answered → authz valid"),
    ("to finalize", "authz re-poll (library)", "stop the standalone server"),
    ("finalize to cert", "finalize, poll, download", "the same (a 1 s sleep)"),
    ("store, serve", "write, rescan, next client handshake", "write files, exit"),
)


def report(args: argparse.Namespace, info: dict[str, str], r: dict[str, Any]) -> str:
    lchat = [s.seconds for s in r["lchat"]]
    cb = [c.seconds for c in r["certbot"]]
    starts = r["starts"]
    n = len(lchat)
    cb_net = med(cb) - med(starts)
    rows: list[list[object]] = [
        [f"first certificate, median (n={n})", f"**{ms(med(lchat))}**", f"**{ms(med(cb))}**"],
        ["p90", ms(pct(lchat, 0.9)), ms(pct(cb, 0.9))],
        ["max", ms(max(lchat)), ms(max(cb))],
        ["first host (registers the account)", ms(lchat[0]), ms(cb[0])],
        ["process start (`certbot --version`), median", "-", ms(med(starts))],
        ["first certificate less certbot's process start, median", ms(med(lchat)), ms(cb_net)],
    ]
    table_rows = [[*row, ratio(_parse_ms(row[1]), _parse_ms(row[2]))] for row in rows]
    storm = r.get("storm")
    if storm:
        runs = storm["runs"]
        t0 = min(s.t0 for s in runs)
        everyone = max(s.t1 for s in runs) - t0
        table_rows += [
            [
                f"{len(runs)} concurrent first handshakes: orders placed",
                f"{storm['orders']:g}",
                "-",
                "-",
            ],
            [f"{len(runs)} concurrent: all served", ms(everyone), "-", "-"],
            [
                f"{len(runs)} concurrent: per client, median",
                ms(med([s.seconds for s in runs])),
                "-",
                "-",
            ],
        ]
    shared = r.get("shared")
    if shared:
        table_rows += [
            [
                f"shared cache: box A's first certificate, median (n={len(shared['a'])})",
                ms(med([s.seconds for s in shared["a"]])),
                "-",
                "-",
            ],
            [
                "shared cache: box B's first contact (from the bucket), median",
                ms(med([s.seconds for s in shared["b"]])),
                "-",
                "-",
            ],
            ["shared cache: box B, max", ms(max(s.seconds for s in shared["b"])), "-", "-"],
        ]

    out = [
        "## ACME issuance (`bench/issuance.py`)",
        "",
        benchlib.machine_markdown(
            {k: info[k] for k in ("date", "commit", "cpus", "memory", "python", "twisted")}
        ),
        f"- certbot: {r['certbot_version']}; the router's acme library: {r['acme_version']}; "
        f"Pebble: Debian {_dpkg_version('pebble')}",
        f"- run time: {r['run_time']:.0f} s",
        "",
        f"Pebble with `PEBBLE_VA_NOSLEEP=1` (validation at once) and `PEBBLE_AUTHZREUSE=0`, one per "
        f"side (each validates HTTP-01 on its own loopback port); {n} hosts per side, one at a time, "
        f"lchat and certbot interleaved. lchat = a TLS handshake with SNI to `twistd lchat` (no "
        f"`default.pem`: it fails at once and starts the order), then one every "
        f"{args.poll * 1000:g} ms until a certificate verifying against Pebble's root is served; "
        f"certbot = `certbot certonly --standalone` spawned until it exits (certificate on disk, "
        f"not yet served by anything). certbot's time includes its process start, measured "
        f"apart as `certbot --version` once per round. Ratio = lchat / certbot.",
        "",
        benchlib.table(["metric", "lchat", "certbot", "ratio"], table_rows),
        "",
    ]
    if storm:
        runs = storm["runs"]
        out.append(
            f"Concurrency: {len(runs)} clients released by a barrier, each polling every "
            f"{args.poll * 1000:g} ms; {sum(s.tries for s in runs)} handshakes in all, "
            f"{storm['failed']:g} of them refused (`no_certificate`) by the router; "
            f"{storm['serials']} distinct certificate(s) served. Orders = the delta of "
            f'`lchat_acme_orders_total{{type="host"}}` on the admin socket\'s `/metrics`.'
        )
        out.append("")
    if shared:
        out.append(
            f"Shared cache: moto, routers A (127.0.0.1, where Pebble validates) and B (127.0.0.2), "
            f"`LCHAT_CERT_CACHE=s3`, A's sync 1s, B's 1h (so only the first-contact path can give B "
            f"the certificate). Per host A first (its order takes the bucket's lock and uploads), "
            f"then B, polling every {args.fine_poll * 1000:g} ms (its path is short), until B "
            f"serves A's serial. Orders: A {shared['orders_a']:g}, B "
            f"{shared['orders_b']:g}; B took {shared['shared_b']:g} from the bucket."
        )
        out.append("")
    timelines = r.get("timelines")
    if timelines:
        out.extend(breakdown(timelines, r["certbot"]))
    out.extend(f"**{note}**\n" for note in r["skipped"])
    out.append(
        "CPU used by other processes on the machine (not this benchmark's), % of one core: "
        + ", ".join(f"{k} {v * 100:.0f}%" for k, v in r["other"].items())
        + "."
    )
    out.append("")
    return "\n".join(out)


def breakdown(timelines: list[Timeline], certbot_runs: list[CertbotRun]) -> list[str]:
    lp = [t.phases() for t in timelines]
    cp = [c.phases for c in certbot_runs if c.phases]

    def m(rows: list[dict[str, float]], key: str) -> float:
        return med([row[key] for row in rows if key in row])

    waited = sum(1 for row in lp if row["polls"] > 1)
    answers: dict[str, int] = {}
    for t in timelines:
        status = t.status.get("begin_finalization:end", "?")
        answers[status] = answers.get(status, 0) + 1
    finalized = ", ".join(f"`{k}` ({v} of {len(timelines)})" for k, v in sorted(answers.items()))
    rows = []
    for key, what_l, what_c in PHASES:
        rows.append([key, what_l, ms(m(lp, key)), what_c, ms(m(cp, key))])
    total_l = med([t.served.seconds for t in timelines])
    total_c = med([c.seconds for c in certbot_runs if c.phases])
    rows.append(["**total**", "", f"**{ms(total_l)}**", "", f"**{ms(total_c)}**"])
    detail = (
        f"Within lchat's phases (medians): the account (key + registration, first order only) "
        f"{ms(max(t.phases()['account'] for t in timelines))} once; the CA fetched the challenge "
        f"{ms(m(lp, 'ca fetch'))} after the answer was posted; the validation wait polls the "
        f"authorization at once, then after 20 ms (doubling): {waited} of {len(lp)} orders "
        f"needed more than the first poll; the "
        f"finalize POST took {ms(m(lp, 'finalize post'))} and Pebble answered it with the order "
        f"{finalized}; the rest of 'finalize to cert' is our finalization poll (at once, then "
        f"50 ms, doubling; the acme library's own `poll_finalization` would sleep 1 s first); "
        f"writing the "
        f"file (fsync) {ms(m(lp, 'write'))}, the certificate store's rescan "
        f"{ms(m(lp, 'rescan'))}, and the client's next handshake came "
        f"{ms(m(lp, 'client poll'))} after the install. certbot's 'account' (its account and "
        f"directory, before it asks for the order): {ms(m(cp, 'account'))}."
    )
    return [
        f"Where the time goes (medians; lchat: {len(timelines)} hosts on a router whose process "
        f"timestamps the issuer's steps, `--child-router`; certbot: its debug log, "
        f"{len(cp)} runs):",
        "",
        benchlib.table(["phase", "lchat", "lchat time", "certbot", "certbot time"], rows),
        "",
        detail,
        "",
    ]


def _parse_ms(text: object) -> float:
    m = re.search(r"([\d.]+) ms", str(text))
    return float(m.group(1)) / 1000 if m else float("nan")


def _dpkg_version(package: str) -> str:
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True
        )
    except OSError:
        return "?"
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-router"]:
        child_router(sys.argv[2:])
    else:
        main()

"""Home (issue 19): vault read and CAS write latency and throughput, the home process's CPU per
operation and the S3 requests per operation, on SQLite, S3 on moto and S3 on SeaweedFS; beside
it, as the anchor measured in the same run, a direct S3 GET/PUT of the same object size through
the same client (lchat.objstore's S3Store).

    .venv/bin/python bench/home.py [--clients 8] [--rounds 3] [--duration 4] [--warmup 1]
        [--vault-bytes 8192] [--backends sqlite,moto,seaweedfs] [--wire-ops 20] [--idle 61]
        [--no-limits-check] [--keep]

(~7 min with the defaults; needs the test extras — boto3, moto, seaweedfs — as
tests/s3servers.py does: .venv has them.) Prints a Markdown section and writes it to
/tmp/home-section.md.

What runs, all on loopback:

- per S3 backend, its server (tests/s3servers.py) and one bucket with **versioning enabled**
  (home refuses to start without it);
- **home**: ``twistd -n --pidfile= lchat-home --env-file <tmp>/home-<backend>.env`` on a unix
  socket (``LCHAT_HOME_STORE=sqlite`` or ``s3`` with ``LCHAT_HOME_S3_ENDPOINT`` the server), with
  **every rate limit off** (each ``LCHAT_HOME_LIMIT_*=0``: every client here is one address,
  ``local``, reading thousands of times a minute) and ``LCHAT_HOME_MAX_DEVICES=200`` (the shared
  account links a device per client per round: ``--clients`` x (``--rounds`` + 1) <= 200);
- **clients**: ``--clients`` asyncio tasks in this process, each on its own kept-alive
  HTTP/1.1 connection to home's socket (no router in between: home's own cost is measured);
- **the anchor** (S3 only): the same number of tasks calling an ``S3Store`` in this process
  (Twisted's asyncio reactor on this process's loop), built with home's client settings.

Set-up per backend: ``--clients`` + 1 accounts are registered over the API, each with a software
authenticator of its own (tests/authenticator.py: a login picks its one passkey), each client
owns one, the last is shared; each account's vault is created (``If-None-Match: *``,
``--vault-bytes`` random bytes). Before every home phase each client gets a fresh link token from
a fresh login ceremony (``/api/login/begin``, the passkey's assertion, ``/api/login/finish``,
then ``POST /api/tokens`` with that proof: a proof mints one token), so every measured read finds
its token in home's token cache (a token checked today; lchat.home.revocation), as a device seen
today does.

Phases, each ``--warmup`` seconds (not counted) then ``--duration`` seconds, clients in a closed
loop (the next request when the previous answer is in), ``--rounds`` rounds of all of them in
this order (each home operation right after its anchor, so both meet the same machine):

- ``direct S3 GET`` (anchor): each task its own object of home's stored size (the 18 KiB cap +
  a 4-byte length header: home pads every vault to it);
- ``vault GET``: ``GET /api/vault``, each client its own account;
- ``direct S3 PUT If-Match`` (anchor): each task its own object, conditioned on the ETag its
  previous PUT returned;
- ``vault PUT If-Match``: ``PUT /api/vault`` with ``If-Match`` the version its previous write
  returned, each client its own account (never loses);
- ``direct S3 PUT If-Match, contended`` (anchor): every task on one object; a 412 is followed
  by a HEAD for the current ETag (what home does to answer a 409), which the next PUT names;
- ``vault PUT If-Match, contended``: every client on the shared account (each with its own
  device's token); a 409 gives the current version, which the client's next PUT names at once
  (no re-read: its bytes are random, there is nothing to merge).

On SQLite (unless ``--no-limits-check``), the **limiter's cost**: two more home processes, set
up the same way (each account registered from an address of its own: ``X-Forwarded-For``, as the
router appends it), whose clients read their own vaults from one address (``local``) right after
``vault GET``: ``vault GET, limits on, never binding`` (every limit ``1000000/1``: consulted and
charged, never refusing) and ``vault GET, limits at defaults, refused (429)`` (the default
limits, each phase after the clients read until refused: its answers are 429s, but for the
bucket's refill). Their CPU per request beside ``vault GET``'s, per round. Two processes' CPU per
request varies more from round to round on a shared machine than the bookkeeping would add, so
the limiter's work for one served read (the failures check, the address's and the account's
buckets) is also timed alone in this process, limits on and off.

Per phase: latency p50/p99 of each request, throughput, the home process's CPU (utime+stime of
``/proc/<pid>/stat``) per request, and, per request, the S3 requests by type counted by home's S3
client (``lchat_s3_requests_total`` on home's admin socket ``/metrics``, every attempt counted)
and home's store operations (``lchat_home_store_operations_total``). The anchor's CPU per request
is this process's (only the S3Store works then).

Then, per S3 backend, the **wire check**: a second home process whose S3 endpoint is a counting
HTTP proxy (bench/backup.py's ``CountingProxy``) in front of the same server, driven by one
client one request at a time, each request's S3 requests counted at the wire by method and key:
the first authenticated read of a token that the other home process saw today (not in this one's
cache: another replica), ``--wire-ops`` cached reads, then, after ``--idle`` seconds (longer than
the 60 s the cache used to last), ``--wire-ops`` reads of that token seen today, writes, and
stale writes (a 409 each). The revocation feed's polls (one LIST of ``revoked/`` every
``LCHAT_HOME_REVOCATION_POLL`` seconds) are background requests: counted apart, not per request.

Goals (issue 19): a vault read is one GET, a write is one conditional PUT (+ one HEAD/GET on a
conflict), and an authenticated read of a token seen today costs no request for the
authentication. The limits' checks (issue 29): the limiter's bookkeeping is under 5% of a served
read's CPU; a 429 costs less CPU than a served read. With ``--keep`` the temp dir keeps every process's log.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import importlib.metadata
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from attrs import define, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib
from benchlib import BIN, Processes, log

OUT = Path("/tmp/home-section.md")
ORIGIN = "https://home.bench.test"  # the WebAuthn origin the software authenticator reports
HOST = "home.bench.test"
BACKENDS = ("sqlite", "moto", "seaweedfs")
S3_KINDS = ("GET", "PUT", "HEAD", "LIST", "DELETE", "feed", "other")
# The wire check's steps, in order.
FIRST_READ = "first read of a token seen today, not checked by this process"
CACHED_READS = "reads, the token checked < 60 s ago by this process"
SEEN_TODAY = "reads of a token this process checked today, over 60 s ago"
WRITES = "writes, If-Match the current version"
STALE_WRITES = "stale writes (409)"
# lchat_s3_requests_total's operation label -> the HTTP request it is.
FEED_OPERATIONS = ("revoked_since", "mark_revoked")  # the revocation feed's store operations
S3_OPERATION_KIND = {
    "GetObject": "GET",
    "PutObject": "PUT",
    "HeadObject": "HEAD",
    # Home lists objects only to poll its revocation feed (revoked/): a background request every
    # LCHAT_HOME_REVOCATION_POLL seconds, not part of any API request.
    "ListObjectsV2": "feed",
    "ListObjectVersions": "LIST",
    "DeleteObject": "DELETE",
}


# Home's settings for the throughput phases: every rate limit off (the benchmark's clients all
# come from one address, "local", and read thousands of times a minute) and a device cap above
# what the run links (a device per login: the shared account gets one per client per round).
def _limit_settings(value: str) -> dict[str, str]:
    from lchat.home.config import DEFAULTS

    names = [
        k for k in DEFAULTS if k.startswith("LCHAT_HOME_LIMIT_") and k != "LCHAT_HOME_LIMIT_KEYS"
    ]
    assert len(names) == 8, names  # lchat.home.limits.NAMES: a new limit must be turned off here
    return dict.fromkeys(names, value)


MAX_DEVICES = 200  # LCHAT_HOME_MAX_DEVICES's ceiling (lchat.home.config.MAX_DEVICES_CEILING)
LIMITS_OFF = {**_limit_settings("0"), "LCHAT_HOME_MAX_DEVICES": str(MAX_DEVICES)}
# Every limit on, a million a second: the buckets are consulted and charged, never empty.
LIMITS_NEVER_BINDING = _limit_settings("1000000/1")
LIMITS_ON = "limits on, never binding"
LIMITS_DEFAULT = "limits at defaults, refused (429)"


# ---------------------------------------------------------------- the client


class UnixHTTP:
    """One kept-alive HTTP/1.1 connection to a unix socket (asyncio): the benchmark's client.
    Sequential use only (no pipelining), which is how each benchmark task uses it."""

    def __init__(self, path: Path) -> None:
        self._path = str(path)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(
        self,
        method: str,
        target: str,
        headers: tuple[tuple[str, str], ...] = (),
        body: bytes = b"",
    ) -> tuple[int, dict[str, str], bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_unix_connection(self._path)
        reader, writer = self._reader, self._writer
        assert reader is not None
        lines = [f"{method} {target} HTTP/1.1", f"Host: {HOST}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        got: dict[str, str] = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                got[name.strip().lower()] = value.strip()
        if "chunked" in got.get("transfer-encoding", "").lower():
            data = bytearray()
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                data += await reader.readexactly(size)
                await reader.readexactly(2)
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            payload = bytes(data)
        else:
            payload = await reader.readexactly(int(got.get("content-length", "0")))
        if got.get("connection", "").lower() == "close":
            self.close()
        return status, got, payload

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def call(
    sock: Path, method: str, path: str, body: Any = None, address: str = ""
) -> tuple[int, Any]:
    """One blocking JSON request to home's API socket (set-up only): (status, JSON body).
    ``address``: the client address home limits it as (the ``X-Forwarded-For`` entry the router
    would append); none: every request of the run is one client, ``local``."""
    conn = benchlib.UnixHTTPConnection(str(sock), timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Host": HOST, "Content-Type": "application/json"}
        if address:
            headers["X-Forwarded-For"] = address
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(payload)
    except ValueError:
        return resp.status, payload


# ---------------------------------------------------------------- home processes


@define
class Home:
    """One ``twistd lchat-home`` process."""

    name: str
    proc: subprocess.Popen[bytes]
    socket: Path
    admin: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_home(procs: Processes, tmp: Path, name: str, settings: dict[str, str]) -> Home:
    root = tmp / name
    (root / "data").mkdir(parents=True)
    (root / "run").mkdir()
    env_file = tmp / f"{name}.env"
    values = {
        "LCHAT_DATA_DIR": str(root / "data"),
        "LCHAT_RUN_DIR": str(root / "run"),
        "LCHAT_HOME_ORIGINS": ORIGIN,
        # One key for every home process of the run (a bench constant, not a secret).
        "LCHAT_HOME_SESSION_KEY": base64.b64encode(b"bench-home-session-key-32-bytes!").decode(),
        **settings,
    }
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LCHAT_", "AWS_"))}
    proc = procs.start(
        name,
        [str(BIN / "twistd"), "-n", "--pidfile=", "lchat-home", "--env-file", str(env_file)],
        env=env,
    )
    home = Home(name, proc, root / "run" / "home.sock", root / "run" / "home-admin.sock")

    def ready() -> bool:
        try:
            return call(home.socket, "GET", "/api/version")[0] == 200
        except OSError:
            return False

    try:
        benchlib.wait_until(ready, 60, f"{name} to answer", procs)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{procs.tail(name, 40)}") from None
    return home


def home_reactor(procs: Processes, home: Home) -> str:
    """The reactor twistd says it runs (``reactor class: ...`` in its log)."""
    with contextlib.suppress(OSError):
        for line in (procs.workdir / f"{home.name}.log").read_text(errors="replace").splitlines():
            if "reactor class:" in line:
                return line.split("reactor class:", 1)[1].strip().rstrip(".")
    return "?"


@define
class Account:
    """A registered account: its uid and its passkey (a software authenticator of its own, the
    only credential it holds: a login picks the newest one, as a browser does), and the client
    address its set-up requests come from (see :func:`call`)."""

    uid: str
    authenticator: Any  # tests.authenticator.SoftwareAuthenticator
    address: str = ""


def register(home: Home, authenticator: Any, address: str = "") -> Account:
    status, started = call(home.socket, "POST", "/api/register/begin", {}, address)
    if status != 200:
        raise RuntimeError(f"register/begin: {status} {started}")
    created = authenticator.create(started["options"], origin=ORIGIN)
    status, done = call(
        home.socket,
        "POST",
        f"/api/register/finish?session={started['session']}",
        {"credential": created},
        address,
    )
    if status != 200:
        raise RuntimeError(f"register/finish: {status} {done}")
    return Account(done["uid"], authenticator, address)


def mint(home: Home, account: Account) -> str:
    """A link token (a new device) from a fresh login ceremony: a proof mints one token."""
    status, started = call(home.socket, "POST", "/api/login/begin", {}, account.address)
    if status != 200:
        raise RuntimeError(f"login/begin: {status} {started}")
    asserted = account.authenticator.get(started["options"], origin=ORIGIN)
    status, done = call(
        home.socket,
        "POST",
        f"/api/login/finish?session={started['session']}",
        {"credential": asserted},
        account.address,
    )
    if status != 200 or done.get("uid") != account.uid:
        raise RuntimeError(f"login/finish: {status} {done} (expected uid {account.uid})")
    status, minted = call(
        home.socket, "POST", "/api/tokens", {"proof": done["proof"]}, account.address
    )
    if status != 200:
        raise RuntimeError(f"POST /api/tokens: {status} {minted}")
    token: str = minted["token"]
    return token


# ---------------------------------------------------------------- metrics


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
COUNTED = ("_total", "_count", "_sum", "_bucket")  # the samples that only grow: deltas work


def scrape(admin: Path) -> Samples:
    """Every counter of home's admin ``/metrics``: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = benchlib.admin(admin, "GET", "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"GET /metrics: {status}")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.endswith(COUNTED):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def own_samples() -> Samples:
    """This process's counters (the anchor's S3Store counts into them)."""
    from prometheus_client import REGISTRY

    out: Samples = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.endswith(COUNTED):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def delta(before: Samples, after: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample == name:
            out[dict(labels)[label]] += value
    return dict(out)


def s3_kinds(samples: Samples) -> dict[str, float]:
    """S3 requests by HTTP kind (GET, PUT, HEAD, ...), every attempt, from our client's counter."""
    out: dict[str, float] = dict.fromkeys(S3_KINDS, 0.0)
    for operation, n in by_label(samples, "lchat_s3_requests_total", "operation").items():
        out[S3_OPERATION_KIND.get(operation, "other")] += n
    return out


# ---------------------------------------------------------------- phases


@define
class Phase:
    """One measured phase: what the clients saw and what it cost."""

    backend: str
    name: str
    clients: int
    latencies: list[float]
    outcomes: collections.Counter[str]
    seconds: float
    server_cpu: float  # the home process (or, for the anchor, this process) per the whole phase
    store_server_cpu: float  # the S3 server process (0 on SQLite)
    other_cpu: float  # the rest of the machine, not this benchmark
    counters: Samples = field(factory=dict)  # the counter deltas (home's, or ours for the anchor)

    @property
    def requests(self) -> int:
        return len(self.latencies)

    def per_request(self, n: float) -> float:
        return n / self.requests if self.requests else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


Worker = Callable[[], Awaitable[str]]


async def drive(workers: list[Worker], duration: float) -> tuple[list[float], Any, float]:
    """Every worker in a closed loop until ``duration`` has passed; each finishes the request it
    is in. Returns the latencies, the outcomes (what each worker call returned) and the time from
    start until the last one finished."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    latencies: list[float] = []
    outcomes: collections.Counter[str] = collections.Counter()

    async def run(worker: Worker) -> None:
        while loop.time() < deadline:
            started = time.perf_counter()
            outcome = await worker()
            latencies.append(time.perf_counter() - started)
            outcomes[outcome] += 1

    started = time.perf_counter()
    await asyncio.gather(*(run(w) for w in workers))
    return latencies, outcomes, time.perf_counter() - started


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(
    backend: str,
    name: str,
    workers: list[Worker],
    args: argparse.Namespace,
    *,
    home: Home | None,
    store_pids: list[int],
) -> Phase:
    """A warm-up, then the measured run, with the CPU and counter deltas around it. ``home``
    None: the anchor (this process's own CPU and counters)."""
    log(f"{backend}: {name}, {len(workers)} clients, {args.warmup:g} s + {args.duration:g} s")
    await drive(workers, args.warmup)

    def counters() -> Samples:
        return scrape(home.admin) if home is not None else own_samples()

    def server_cpu() -> float:
        return benchlib.cpu_seconds([home.pid]) if home is not None else own_cpu()

    before = counters()
    cpu0, store0, mine0, busy0 = (
        server_cpu(),
        benchlib.cpu_seconds(store_pids),
        own_cpu(),
        benchlib.busy_cpu_seconds(),
    )
    latencies, outcomes, seconds = await drive(workers, args.duration)
    cpu1, store1, mine1, busy1 = (
        server_cpu(),
        benchlib.cpu_seconds(store_pids),
        own_cpu(),
        benchlib.busy_cpu_seconds(),
    )
    after = counters()
    ours = (mine1 - mine0) + ((cpu1 - cpu0) if home is not None else 0.0) + (store1 - store0)
    phase = Phase(
        backend,
        name,
        len(workers),
        latencies,
        outcomes,
        seconds,
        cpu1 - cpu0,
        store1 - store0,
        max(0.0, (busy1 - busy0) - ours),
        delta(before, after),
    )
    log(
        f"  {phase.requests} requests, {phase.requests / seconds:,.0f}/s, "
        f"p50 {phase.percentile(0.5) * 1000:.2f} ms, p99 {phase.percentile(0.99) * 1000:.2f} ms, "
        f"outcomes {dict(outcomes)}"
    )
    return phase


@define
class Client:
    """One benchmark client of home: its connection, token and the version it last saw."""

    conn: UnixHTTP
    home: Home  # the process its tokens come from (and its conn goes to)
    account: Account
    token: str = ""
    version: str = "0"


def vault_get(client: Client) -> Worker:
    async def get() -> str:
        auth = (("Authorization", f"Bearer {client.token}"),)
        status, _, _ = await client.conn.request("GET", "/api/vault", auth)
        return str(status)

    return get


def vault_put(
    client: Client, size: int, replaced: collections.Counter[str] | None = None
) -> Worker:
    """A conditional PUT naming the version this client saw last; ``replaced`` counts the
    versions its won writes replaced (a version replaced twice is a lost update)."""

    async def put() -> str:
        expected = client.version
        headers = (
            ("Authorization", f"Bearer {client.token}"),
            ("Content-Type", "application/octet-stream"),
            ("If-Match", f'"{expected}"'),
        )
        status, _, body = await client.conn.request("PUT", "/api/vault", headers, os.urandom(size))
        if status == 200:
            client.version = json.loads(body)["version"]
            if replaced is not None:
                replaced[expected] += 1
        elif status == 409:
            client.version = json.loads(body)["current"]
        return str(status)

    return put


async def create_vault(client: Client, size: int) -> None:
    headers = (
        ("Authorization", f"Bearer {client.token}"),
        ("Content-Type", "application/octet-stream"),
        ("If-None-Match", "*"),
    )
    status, _, body = await client.conn.request("PUT", "/api/vault", headers, os.urandom(size))
    if status == 200:
        client.version = json.loads(body)["version"]
    elif status == 409:  # the shared account's vault, created by another client already
        client.version = json.loads(body)["current"]
    else:
        raise RuntimeError(f"creating a vault: {status} {body[:200]!r}")


# ---------------------------------------------------------------- one backend


@define
class Wire:
    """The wire check of one S3 backend: per step, the S3 requests by (method, key kind)."""

    steps: list[tuple[str, int, dict[str, int], list[str]]] = field(factory=list)
    unframed: int = 0
    feed_lists: int = 0  # LISTs of revoked/ (the revocation feed's polls), over feed_seconds
    feed_seconds: float = 0.0


@define
class Summary:
    """One operation on one backend over every round: medians of the rounds' figures, sums of
    their counts."""

    backend: str
    name: str
    clients: int
    rounds: list[Phase] = field(factory=list)
    writes_won: int = 0  # every round and warm-up
    lost_updates: int = 0  # won writes that replaced a version another won write replaced too

    @property
    def requests(self) -> int:
        return sum(p.requests for p in self.rounds)

    @property
    def outcomes(self) -> collections.Counter[str]:
        return sum((p.outcomes for p in self.rounds), collections.Counter())

    @property
    def counters(self) -> Samples:
        out: Samples = collections.defaultdict(float)
        for phase in self.rounds:
            for k, v in phase.counters.items():
                out[k] += v
        return dict(out)

    def median(self, figure: Callable[[Phase], float]) -> float:
        return statistics.median(figure(p) for p in self.rounds)

    def spread(self, figure: Callable[[Phase], float]) -> tuple[float, float]:
        values = [figure(p) for p in self.rounds]
        return min(values), max(values)


@define
class Result:
    backend: str
    summaries: list[Summary] = field(factory=list)
    wire: Wire | None = None
    reactor: str = "?"  # the home process's reactor, as twistd logged it


async def bench_backend(
    reactor: Any,
    kind: str,
    args: argparse.Namespace,
    tmp: Path,
    procs: Processes,
    servers: list[Any],
) -> Result:
    from lchat.home.api import pad
    from lchat.objstore import PreconditionFailed
    from lchat.objstore.s3 import S3Store
    from lchat.threads import thread_runner
    from tests.authenticator import SoftwareAuthenticator

    result = Result(kind)
    settings: dict[str, str] = {}
    server = None
    store_pids: list[int] = []
    if kind != "sqlite":
        from tests.s3servers import S3Server

        log(f"starting {kind}")
        server = S3Server(kind)  # type: ignore[arg-type]
        servers.append(server)
        server.start_sync()
        bucket = server.new_bucket_sync("bench-home")
        server.client().put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
        )
        # Its process and children: the S3 server's CPU per phase (the fixture keeps its Popen
        # private; this is a benchmark reading it, not a test relying on it).
        assert server._proc is not None
        pid = server._proc.pid
        store_pids = [pid, *benchlib.children(pid)]
        settings = {
            "LCHAT_HOME_STORE": "s3",
            "LCHAT_HOME_S3_BUCKET": bucket,
            "LCHAT_HOME_S3_REGION": server.region,
            "LCHAT_HOME_S3_ENDPOINT": server.endpoint,
            "AWS_ACCESS_KEY_ID": server.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": server.credentials.secret_key,
        }
    settings = {**settings, **LIMITS_OFF}
    log(f"{kind}: starting home (limits off)")
    home = start_home(procs, tmp, f"home-{kind}", settings)
    homes = [home]
    result.reactor = home_reactor(procs, home)
    # One passkey (software authenticator) per account: a login picks it, as a browser would.
    accounts = [register(home, SoftwareAuthenticator()) for _ in range(args.clients + 1)]
    own = [Client(UnixHTTP(home.socket), home, a) for a in accounts[:-1]]
    shared = [Client(UnixHTTP(home.socket), home, accounts[-1]) for _ in range(args.clients)]

    async def fresh_tokens(clients: list[Client]) -> None:
        # Minted now, each from its own login (and so checked today), so every measured read
        # finds its token cached.
        for client in clients:
            client.token = mint(client.home, client.account)

    await fresh_tokens(own + shared)
    for client in own + shared:
        await create_vault(client, args.vault_bytes)

    # The limiter's own cost (SQLite only: no S3 server's noise): two more home processes whose
    # clients read their own vaults as ``own`` do, every request from one address ("local": no
    # X-Forwarded-For) — one with every limit on but never binding (its bookkeeping on a served
    # read), one at the default limits (past 300 requests a minute every read is a 429).
    limited: dict[str, list[Client]] = {}
    if kind == "sqlite" and args.limits_check:
        for label, suffix, extra in (
            (LIMITS_ON, "limits-on", LIMITS_NEVER_BINDING),
            (LIMITS_DEFAULT, "limits-default", {}),
        ):
            log(f"{kind}: starting home ({label})")
            other = start_home(procs, tmp, f"home-{kind}-{suffix}", extra)
            homes.append(other)
            # Set-up from an address per account (LCHAT_HOME_LIMIT_REGISTER_IP is 10 an hour).
            clients = [
                Client(
                    UnixHTTP(other.socket),
                    other,
                    register(other, SoftwareAuthenticator(), f"198.51.100.{i + 1}"),
                )
                for i in range(args.clients)
            ]
            await fresh_tokens(clients)
            for client in clients:
                await create_vault(client, args.vault_bytes)
            limited[label] = clients

    async def drain(clients: list[Client]) -> None:
        """Every client reads until refused: the measured phase meets an empty bucket."""
        for client in clients:
            for _ in range(10_000):
                if await vault_get(client)() == "429":
                    break
            else:
                raise RuntimeError("no 429 after 10,000 reads at the default limits")

    loop = asyncio.get_running_loop()

    def tw(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        from twisted.internet.defer import Deferred

        return Deferred.fromCoroutine(coro).asFuture(loop)

    s3: S3Store | None = None
    etags: dict[int, str] = {}
    stored = len(pad(b""))  # what home stores for any vault: the anchor's object size

    def direct_get(i: int) -> Worker:
        async def w() -> str:
            assert s3 is not None
            await tw(s3.get(f"anchor/{i}"))
            return "200"

        return w

    def direct_put(i: int, key: str, replaced: collections.Counter[str]) -> Worker:
        """A conditional PUT of ``key`` naming the ETag this task saw last; on a lost race, a
        HEAD for the current one (what home does to answer its 409)."""

        async def w() -> str:
            assert s3 is not None
            expected = etags[i]
            try:
                done = await tw(s3.put(key, os.urandom(stored), if_match=expected))
            except PreconditionFailed:
                etags[i] = (await tw(s3.head(key))).etag
                return "412"
            etags[i] = done.etag
            replaced[expected] += 1
            return "200"

        return w

    # Per writing phase: the versions its won writes replaced (each at most once, or an update
    # was lost: compare-and-swap failed).
    replaced: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def tokens(clients: list[Client]) -> Callable[[], Awaitable[None]]:
        return lambda: fresh_tokens(clients)

    async def nothing() -> None:
        pass

    # (name, its workers, home or None for the anchor, what to do first: mint its clients' tokens);
    # each round runs them in this order, so that an operation and its anchor are measured back
    # to back.
    plan: list[tuple[str, list[Worker], Home | None, Callable[[], Awaitable[None]]]] = []
    if server is not None:
        workers = [direct_get(i) for i in range(args.clients)]
        plan.append(("direct S3 GET", workers, None, nothing))
    plan.append(("vault GET", [vault_get(c) for c in own], home, tokens(own)))

    def limited_prepare(label: str, clients: list[Client]) -> Callable[[], Awaitable[None]]:
        async def go() -> None:
            await fresh_tokens(clients)
            if label == LIMITS_DEFAULT:
                await drain(clients)

        return go

    for label, clients in limited.items():
        workers = [vault_get(c) for c in clients]
        plan.append(
            (f"vault GET, {label}", workers, clients[0].home, limited_prepare(label, clients))
        )
    if server is not None:
        name = "direct S3 PUT If-Match"
        workers = [direct_put(i, f"anchor/{i}", replaced[name]) for i in range(args.clients)]
        plan.append((name, workers, None, nothing))
    name = "vault PUT If-Match"
    workers = [vault_put(c, args.vault_bytes, replaced[name]) for c in own]
    plan.append((name, workers, home, tokens(own)))
    if server is not None:
        name = "direct S3 PUT If-Match, contended"
        workers = [
            direct_put(args.clients + i, "anchor/shared", replaced[name])
            for i in range(args.clients)
        ]
        plan.append((name, workers, None, nothing))
    name = "vault PUT If-Match, contended"
    workers = [vault_put(c, args.vault_bytes, replaced[name]) for c in shared]
    plan.append((name, workers, home, tokens(shared)))

    try:
        if server is not None:
            # home's client as tap.open_store builds it: S3Store's defaults, path-style.
            s3 = S3Store(
                reactor,
                settings["LCHAT_HOME_S3_BUCKET"],
                run_in_thread=thread_runner(reactor),
                monotonic=time.monotonic,
                region=server.region,
                endpoint=server.endpoint,
                credentials=server.credentials,
            )
            for i in range(args.clients):
                etags[i] = (await tw(s3.put(f"anchor/{i}", os.urandom(stored)))).etag
            shared_etag = (await tw(s3.put("anchor/shared", os.urandom(stored)))).etag
            etags.update({args.clients + i: shared_etag for i in range(args.clients)})
        summaries = {name: Summary(kind, name, len(workers)) for name, workers, _, _ in plan}
        for round_ in range(1, args.rounds + 1):
            for name, workers, target, first in plan:
                await first()
                summaries[name].rounds.append(
                    await measure(
                        kind,
                        f"{name} (round {round_})",
                        workers,
                        args,
                        home=target,
                        store_pids=store_pids,
                    )
                )
        for name, summary in summaries.items():
            if name in replaced:
                summary.writes_won = sum(replaced[name].values())
                summary.lost_updates = sum(n - 1 for n in replaced[name].values() if n > 1)
        result.summaries = list(summaries.values())
        if server is not None:
            result.wire = await wire_check(server, settings, own[0], args, tmp, procs)
    finally:
        if s3 is not None:
            await tw(s3.close())
        for client in own + shared + [c for cs in limited.values() for c in cs]:
            client.conn.close()
        for each in homes:
            procs.stop(each.proc)
    return result


async def wire_check(
    server: Any,
    settings: dict[str, str],
    seen: Client,
    args: argparse.Namespace,
    tmp: Path,
    procs: Processes,
) -> Wire:
    """A second home process on the same bucket through a counting proxy; one client, one
    request at a time, each step's S3 requests counted at the wire."""
    from backup import CountingProxy, classify

    port = int(server.endpoint.rsplit(":", 1)[1])
    proxy = CountingProxy(port, f"{server.kind}-wire")
    wire = Wire()
    home = None
    conn = None
    try:
        home = start_home(
            procs,
            tmp,
            f"home-{server.kind}-wire",
            {**settings, "LCHAT_HOME_S3_ENDPOINT": proxy.url},
        )
        conn = UnixHTTP(home.socket)
        client = Client(conn, home, seen.account, seen.token, seen.version)

        started = time.time()

        async def step(name: str, n: int, work: Worker, expect: str) -> None:
            await asyncio.sleep(0.05)  # the proxy timestamps request heads: keep steps apart
            t0 = time.time()
            for _ in range(n):
                got = await work()
                if got != expect:
                    raise RuntimeError(f"wire check, {name}: answered {got}, expected {expect}")
            await asyncio.sleep(0.2)  # the proxy's relay threads log the last request
            counted: dict[str, int] = collections.Counter()
            samples = []
            for request in proxy.requests(t0, time.time()):
                method, key = classify(request)
                where = key.split("/", 1)[0] + "/" if key else "(bucket)"
                if method == "LIST" and where == "revoked/":
                    continue  # the revocation feed's poll: background, counted apart
                counted[f"{method} {where}"] += 1
                samples.append(f"{method} {key or request.target} -> {request.status}")
            wire.steps.append((name, n, dict(counted), samples))

        def read() -> Worker:
            async def w() -> str:
                auth = (("Authorization", f"Bearer {client.token}"),)
                status, hdrs, _ = await client.conn.request("GET", "/api/vault", auth)
                client.version = hdrs.get("etag", '"0"').strip('"')
                return str(status)

            return w

        stale: list[str] = []

        def stale_put() -> Worker:
            async def w() -> str:
                headers = (
                    ("Authorization", f"Bearer {client.token}"),
                    ("Content-Type", "application/octet-stream"),
                    ("If-Match", f'"{stale[0]}"'),
                )
                body = os.urandom(args.vault_bytes)
                status, _, _ = await client.conn.request("PUT", "/api/vault", headers, body)
                return str(status)

            return w

        # ``seen``'s token was minted and used on the other home process today; this process
        # has never checked it (as another replica).
        await step(FIRST_READ, 1, read(), "200")
        await step(CACHED_READS, args.wire_ops, read(), "200")
        if args.idle > 0:
            # The old 60-second cache is long gone by now; the token was checked today.
            log(f"{server.kind}: wire check, {args.idle:g} s idle (the token stays seen today)")
            await asyncio.sleep(args.idle)
            # twisted.web closes a connection idle for 60 s: a new one (no store request).
            conn.close()
            conn = client.conn = UnixHTTP(home.socket)
            await step(SEEN_TODAY, args.wire_ops, read(), "200")
        await step(WRITES, args.wire_ops, vault_put(client, args.vault_bytes), "200")
        stale.append(client.version)
        await vault_put(client, args.vault_bytes)()  # ``stale`` is now one version behind
        await step(STALE_WRITES, args.wire_ops, stale_put(), "409")
        wire.unframed = proxy.unframed
        await asyncio.sleep(0.2)
        wire.feed_seconds = time.time() - started
        for request in proxy.requests(started, time.time()):
            method, key = classify(request)
            if method == "LIST" and key.split("/", 1)[0] == "revoked":
                wire.feed_lists += 1
    finally:
        if conn is not None:
            conn.close()
        if home is not None:
            procs.stop(home.proc)
        proxy.close()
    return wire


# ---------------------------------------------------------------- the report


def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def per(n: float, d: int) -> str:
    return f"{n / d:.2f}" if d else "-"


def find(result: Result, name: str) -> Summary | None:
    return next((x for x in result.summaries if x.name == name), None)


def histogram_count(counters: Samples, name: str, label: str, value: str, le: str | None) -> float:
    """A histogram's count (``le`` None) or one bucket's (``le`` its bound, e.g. "0.5")."""
    suffix = "_count" if le is None else "_bucket"
    return sum(
        v
        for (sample, labels), v in counters.items()
        if sample == name + suffix
        and dict(labels).get(label) == value
        and (le is None or float(dict(labels)["le"]) == float(le))
    )


def store_seconds(counters: Samples) -> float:
    """Seconds home spent in store operations (``lchat_home_store_seconds_sum``, all of them)."""
    return sum(v for (sample, _), v in counters.items() if sample == "lchat_home_store_seconds_sum")


def summary_row(summary: Summary, direct: Summary | None) -> list[object]:
    n = summary.requests
    anchor = summary.name.startswith("direct")
    counters = summary.counters
    kinds = s3_kinds(counters)
    store = by_label(counters, "lchat_home_store_operations_total", "operation")
    s3 = (
        ", ".join(f"{k} {per(v, n)}" for k, v in kinds.items() if v) or "none"
        if summary.backend != "sqlite"
        else "-"
    )
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(summary.outcomes.items()))
    p50_ratio = rate_ratio = "-"
    if direct is not None:
        # Per round (each operation measured right after its anchor), then the median.
        pairs = list(zip(summary.rounds, direct.rounds, strict=False))
        p50_ratio = (
            f"{statistics.median(a.percentile(0.5) / b.percentile(0.5) for a, b in pairs):.2f}x"
        )
        rate_ratio = f"{statistics.median((a.requests / a.seconds) / (b.requests / b.seconds) for a, b in pairs):.2f}x"
    low, high = summary.spread(lambda p: p.percentile(0.5))
    store_ms = "-" if anchor else f"{store_seconds(counters) / n * 1000:.2f} ms" if n else "-"
    server = summary.median(lambda p: p.per_request(p.store_server_cpu))
    return [
        summary.backend,
        summary.name,
        summary.clients,
        n,
        f"{summary.median(lambda p: p.requests / p.seconds):,.0f}",
        f"**{ms(summary.median(lambda p: p.percentile(0.5)))}** ({ms(low)} to {ms(high)})",
        ms(summary.median(lambda p: p.percentile(0.99))),
        f"{summary.median(lambda p: p.per_request(p.server_cpu)) * 1e6:,.0f} µs"
        + (" (client)" if anchor else ""),
        f"{server * 1e6:,.0f} µs" if server else "-",
        s3,
        "-" if anchor else ", ".join(f"{k} {per(v, n)}" for k, v in sorted(store.items())),
        store_ms,
        outcomes,
        p50_ratio,
        rate_ratio,
    ]


def goals(result: Result, bookkeeping: tuple[float, float] | None = None) -> list[str]:
    """The goal lines of one backend (S3: requests; SQLite: store operations)."""
    lines: list[str] = []
    s3 = result.backend != "sqlite"
    read = find(result, "vault GET")
    write = find(result, "vault PUT If-Match")
    contended = find(result, "vault PUT If-Match, contended")
    assert read is not None and write is not None and contended is not None
    name = result.backend + (" (S3)" if s3 else " (store operations; no S3)")

    def ops(summary: Summary) -> dict[str, float]:
        # Not the revocation feed's polls: a background read every few seconds, not per request.
        counted = by_label(summary.counters, "lchat_home_store_operations_total", "operation")
        return {k: v for k, v in counted.items() if k not in FEED_OPERATIONS}

    auth_ops = {"resolve_pointer", "get_user", "update_user", "put_user"}
    r_ops, w_ops, c_ops = ops(read), ops(write), ops(contended)
    r_auth = sum(v for k, v in r_ops.items() if k in auth_ops)
    conflicts = contended.outcomes.get("409", 0)
    if s3:
        rk, wk, ck = (s3_kinds(x.counters) for x in (read, write, contended))
        r_other = sum(v for k, v in rk.items() if k not in ("GET", "feed"))
        w_other = sum(v for k, v in wk.items() if k not in ("PUT", "feed"))
        c_other = sum(v for k, v in ck.items() if k not in ("PUT", "HEAD", "GET", "feed"))
        c_ok = ck["PUT"] == contended.requests and ck["HEAD"] + ck["GET"] == conflicts
        lines += [
            f"- {name}, read = 1 GET: {verdict(rk['GET'] == read.requests and not r_other)} "
            f"({rk['GET']:.0f} GETs and {r_other:.0f} other requests for {read.requests} vault "
            f"GETs: {per(rk['GET'], read.requests)} GET/read)",
            f"- {name}, write = 1 conditional PUT: "
            f"{verdict(wk['PUT'] == write.requests and not w_other)} ({wk['PUT']:.0f} PUTs and "
            f"{w_other:.0f} other requests for {write.requests} vault PUTs, "
            f"{write.outcomes.get('409', 0)} lost)",
            f"- {name}, contended write = 1 PUT (+1 HEAD/GET per conflict): "
            f"{verdict(c_ok and not c_other)} ({ck['PUT']:.0f} PUTs, {ck['HEAD']:.0f} HEADs, "
            f"{ck['GET']:.0f} GETs, {c_other:.0f} other for {contended.requests} PUTs of which "
            f"{conflicts} lost (409))",
        ]
    else:
        lines += [
            f"- {name}, read = 1 store read: "
            f"{verdict(r_ops.get('get_blob', 0) == read.requests and not r_auth)} "
            f"({per(r_ops.get('get_blob', 0), read.requests)} get_blob/read)",
            f"- {name}, write = 1 conditional write: "
            f"{verdict(w_ops.get('put_blob', 0) == write.requests and len(w_ops) == 1)} "
            f"({per(w_ops.get('put_blob', 0), write.requests)} put_blob/write)",
            f"- {name}, contended write = 1 conditional write: "
            f"{verdict(c_ops.get('put_blob', 0) == contended.requests and len(c_ops) == 1)} "
            f"({per(c_ops.get('put_blob', 0), contended.requests)} put_blob/PUT; {conflicts} of "
            f"{contended.requests} lost (409), the current version read in the same call)",
        ]
    # The goal is home's; the anchors' writes go to the S3 server with nothing in between, so a
    # version they replace twice is the server's If-Match failing, shown apart (home's writes
    # rest on the same If-Match: a server that loses the anchor's may one day lose home's too).
    checked = [x for x in result.summaries if x.writes_won and not x.name.startswith("direct")]
    anchors = [x for x in result.summaries if x.writes_won and x.name.startswith("direct")]
    lost = sum(x.lost_updates for x in checked)
    lines.append(
        f"- {name}, compare-and-swap: no version replaced twice (no lost update): "
        f"{verdict(lost == 0)} ("
        + "; ".join(f"{x.name}: {x.writes_won} won, {x.lost_updates} lost" for x in checked)
        + ", warm-ups included)"
    )
    if anchors:
        anchor_lost = sum(x.lost_updates for x in anchors)
        lines.append(
            f"- {result.backend}, the S3 server alone (the anchors' conditional PUTs): "
            + "; ".join(f"{x.name}: {x.writes_won} won, {x.lost_updates} lost" for x in anchors)
            + (
                f" — **{result.backend} let {anchor_lost} PUT(s) If-Match replace a version "
                "another PUT had replaced: its If-Match is not atomic under contention**"
                if anchor_lost
                else ""
            )
        )
    lines.append(
        f"- {name}, authenticated read of a token checked by this process today = 0 "
        f"requests for the authentication: {verdict(r_auth == 0)} ({r_auth:.0f} store "
        f"operations for authentication over {read.requests} reads)"
    )
    if bookkeeping is not None:
        lines += limiter_lines(result, read, bookkeeping)
    wire = result.wire
    if wire is not None:

        def auth_of(step_name: str) -> tuple[int, dict[str, int]] | None:
            for step, n, counted, _ in wire.steps:
                if step == step_name:
                    return n, {k: v for k, v in counted.items() if k != "GET blobs/"}
            return None

        seen = auth_of(SEEN_TODAY)
        if seen is not None:
            n, auth = seen
            shown = ", ".join(f"{v} {k}" for k, v in sorted(auth.items())) or "none"
            lines.append(
                f"- {name}, **authenticated read of a token seen today** (checked by this process "
                f"today, over 60 s ago) = 0 requests for the authentication: "
                f"{verdict(not auth)} (at the wire, {n} reads: {shown} besides the vault's GETs; "
                f"{sum(auth.values()) / n:.2f} requests per read)"
            )
        first = auth_of(FIRST_READ)
        assert first is not None
        n, auth = first
        writes = sum(v for k, v in auth.items() if not k.startswith(("GET", "HEAD")))
        shown = ", ".join(f"{v} {k}" for k, v in sorted(auth.items())) or "none"
        lines.append(
            f"- {name}, the first read of the day of a token on a process that never checked it "
            f"(another replica; not a goal: each process checks each token once a day): {shown} "
            f"besides the vault's GET; {writes} writes (`last_seen` is daily, written by the "
            f"process that saw it first)"
        )
        if wire.feed_seconds:
            lines.append(
                f"- {result.backend}, the revocation feed (background, not per request): "
                f"{wire.feed_lists} LISTs of `revoked/` in {wire.feed_seconds:.0f} s, one per "
                f"{wire.feed_seconds / max(1, wire.feed_lists):.1f} s "
                f"(`LCHAT_HOME_REVOCATION_POLL`, default 5 s)"
            )
    if s3:
        for summary in (read, write, contended):
            slow = {
                op: histogram_count(
                    summary.counters, "lchat_s3_request_seconds", "operation", op, None
                )
                - histogram_count(
                    summary.counters, "lchat_s3_request_seconds", "operation", op, "0.5"
                )
                for op in S3_OPERATION_KIND
            }
            shown = ", ".join(f"{v:.0f} {k}" for k, v in slow.items() if v)
            if shown:
                lines.append(
                    f"- {result.backend}, {summary.name}: S3 requests slower than 0.5 s "
                    f"(home's `lchat_s3_request_seconds`): {shown}"
                )
    return lines


def limiter_bookkeeping(n: int = 50_000) -> tuple[float, float]:
    """CPU seconds of the limiter's work for one served vault GET (the failures check, the
    address's and the account's buckets, as lchat.home.api takes them), in this process: (every
    limit on, never binding; every limit off). Two home processes' CPU per request differ by
    more than this from run to run on a shared machine, so the bookkeeping is timed alone."""
    from lchat.home.limits import NAMES, Limits, Rate

    out = []
    for rates in ({name: Rate(1_000_000, 1) for name in NAMES}, {}):
        limits = Limits.build(rates, time.monotonic)
        started = time.process_time()
        for _ in range(n):
            limits.check([("failures_ip", "local")])
            limits.take([("ip", "local")])
            limits.take([("account", "uid")])
        out.append((time.process_time() - started) / n)
    return out[0], out[1]


def limiter_lines(result: Result, off: Summary, bookkeeping: tuple[float, float]) -> list[str]:
    """The limiter's cost beside ``off`` (vault GET with every limit off): its bookkeeping per
    served read timed alone, home's CPU per request with every limit on but never binding, and
    per 429 at the defaults (per round, each measured right after ``off``, then the median)."""
    on = find(result, f"vault GET, {LIMITS_ON}")
    refused = find(result, f"vault GET, {LIMITS_DEFAULT}")
    if on is None or refused is None:
        return []

    def cpu(p: Phase) -> float:
        return p.per_request(p.server_cpu)

    def ratio(x: Summary) -> float:
        return statistics.median(cpu(a) / cpu(b) for a, b in zip(x.rounds, off.rounds, strict=True))

    on_ratio, refused_ratio = ratio(on), ratio(refused)
    share = refused.outcomes.get("429", 0) / max(1, refused.requests)
    added = bookkeeping[0] - bookkeeping[1]
    part = added / off.median(cpu) if off.median(cpu) else 0.0
    return [
        f"- {result.backend}, the limiter adds no measurable CPU to a served read (its "
        f"bookkeeping under 5% of a read's CPU): {verdict(part < 0.05)} (the failures check and "
        f"the address's and account's buckets timed alone in the benchmark's process: "
        f"{bookkeeping[0] * 1e6:.1f} µs with every limit on, {bookkeeping[1] * 1e6:.1f} µs off, "
        f"+{added * 1e6:.1f} µs = {part:.1%} of the {off.median(cpu) * 1e6:,.0f} µs home spends "
        f"per read with limits off; a home process with every limit on, never binding: "
        f"{on.median(cpu) * 1e6:,.0f} µs per read, {on_ratio:.2f}x (per round: "
        + ", ".join(f"{cpu(a) / cpu(b):.2f}x" for a, b in zip(on.rounds, off.rounds, strict=True))
        + f"; answers {', '.join(sorted(on.outcomes))}): two processes' CPU per request, "
        "noisier than the bookkeeping it would show)",
        f"- {result.backend}, a read refused at the default limits (`429`, nothing looked up) "
        f"costs less CPU than a served read: {verdict(refused_ratio < 1 and share > 0.95)} "
        f"({refused.median(cpu) * 1e6:,.0f} µs per request, {refused_ratio:.2f}x a served read "
        f"with limits off; {share:.1%} of its answers 429, the rest the bucket's refill)",
    ]


def wire_table(results: list[Result]) -> list[str]:
    rows: list[list[object]] = []
    notes: list[str] = []
    for result in results:
        if result.wire is None:
            continue
        for name, n, counted, samples in result.wire.steps:
            total = sum(counted.values())
            rows.append(
                [
                    result.backend,
                    name,
                    n,
                    ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(counted.items())) or "none",
                    f"{total / n:.2f}",
                ]
            )
            if name == FIRST_READ:
                notes.append(f"- {result.backend}, {name}: " + "; ".join(samples))
        if result.wire.unframed:
            notes.append(
                f"- **{result.backend}: {result.wire.unframed} connection(s) could not be framed "
                "and were not fully counted**"
            )
    if not rows:
        return []
    return [
        "S3 requests per API request at the wire (a second home process on the same bucket "
        "through a counting proxy, one request at a time):",
        "",
        benchlib.table(
            [
                "backend",
                "API requests",
                "n",
                "S3 requests per API request, by method and key",
                "total",
            ],
            rows,
        ),
        "",
        *notes,
    ]


def report(
    args: argparse.Namespace, info: dict[str, str], results: list[Result], seconds: float
) -> str:
    headers = [
        "backend",
        "operation",
        "clients",
        "requests",
        "req/s",
        "p50",
        "p99",
        "home CPU/req",
        "S3 server CPU/req",
        "S3 requests/req (S3Store's counter)",
        "store ops/req",
        "store time/req",
        "outcomes",
        "p50 ÷ direct",
        "req/s ÷ direct",
    ]
    rows = []
    for result in results:
        for summary in result.summaries:
            direct = None
            if not summary.name.startswith("direct"):
                direct = find(result, summary.name.replace("vault", "direct S3"))
            rows.append(summary_row(summary, direct))
    others = [p.other_cpu / p.seconds * 100 for r in results for x in r.summaries for p in x.rounds]
    versions = {"moto": "-", "seaweedfs": "-"}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        versions["moto"] = importlib.metadata.version("moto")
    with contextlib.suppress(OSError):
        versions["seaweedfs"] = subprocess.run(
            [str(BIN / "weed"), "version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    lines = [
        "## Home (`bench/home.py`)",
        "",
        benchlib.machine_markdown(
            {
                **{k: info[k] for k in ("date", "commit", "cpus", "python", "twisted")},
                "moto": versions["moto"],
                "SeaweedFS": versions["seaweedfs"],
                "home's reactor": ", ".join(sorted({r.reactor for r in results})),
                "run time": f"{seconds:.0f} s",
            }
        ),
        "",
        f"`bench/home.py --clients {args.clients} --rounds {args.rounds} --duration "
        f"{args.duration:g} --warmup {args.warmup:g} --vault-bytes {args.vault_bytes} "
        f"--wire-ops {args.wire_ops} --idle {args.idle:g}"
        f"{'' if args.limits_check else ' --no-limits-check'}`: "
        f"{args.clients} clients in a closed loop on their own kept-alive connections to home's "
        f"unix socket (no router), {args.duration:g} s per phase after {args.warmup:g} s of "
        f"warm-up, {args.rounds} rounds (each operation right after its `direct` anchor; "
        "figures are the medians of the rounds', p50 with its range, counts summed); vaults of "
        f"{args.vault_bytes} random bytes (home stores every one padded to "
        "18,436 bytes); `direct` = the same client (S3Store, home's settings) getting and "
        "conditionally putting objects of that stored size, the same number of tasks, in the "
        "benchmark's process. Contended: every client on one account (its own device's token), "
        "a 409 answered by a PUT naming the current version at once; its anchor: every task on "
        "one object, a 412 followed by a HEAD for the current ETag. CPU per request: the home "
        "process's utime+stime (for `direct`, the benchmark process's: the S3 client alone). "
        "S3 requests: home's `lchat_s3_requests_total` (every attempt), store ops: "
        "`lchat_home_store_operations_total`, both from its admin `/metrics`. Home runs with "
        "every `LCHAT_HOME_LIMIT_*` off and `LCHAT_HOME_MAX_DEVICES` "
        f"{MAX_DEVICES} (every client is one address, `local`); each link token comes from a "
        "fresh login ceremony (one passkey per account), one per client before each home phase. "
        "On SQLite, `vault GET, limits ...`: the same reads on two more home processes, one "
        "with every limit on at 1000000/1 (never binding), one at the default limits with "
        "every client's bucket emptied first (its answers are 429s).",
        "",
        benchlib.table(headers, rows),
        "",
        "### Goals",
        "",
    ]
    bookkeeping = limiter_bookkeeping() if args.limits_check else None
    for result in results:
        lines += goals(result, bookkeeping)
    lines += ["", *wire_table(results)]
    lines += [
        "",
        f"CPU used by other processes on the machine during the phases (not this benchmark's), "
        f"% of one core: median {sorted(others)[len(others) // 2]:.0f}%, max {max(others):.0f}%.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients per phase")
    parser.add_argument("--duration", type=float, default=4, help="seconds measured per phase")
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up per phase")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every phase (medians)")
    parser.add_argument("--vault-bytes", type=int, default=8192, help="the client's vault size")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated: sqlite,moto,seaweedfs"
    )
    parser.add_argument("--wire-ops", type=int, default=20, help="requests per wire-check step")
    parser.add_argument(
        "--idle",
        type=float,
        default=61,
        help="seconds the wire check waits before reading a token seen today again (0: skip)",
    )
    parser.add_argument(
        "--no-limits-check",
        dest="limits_check",
        action="store_false",
        help="skip the limiter's phases on SQLite (limits on never binding, at defaults: 429)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir and logs")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if unknown := set(backends) - set(BACKENDS):
        sys.exit(f"unknown backends {sorted(unknown)}: choose from {', '.join(BACKENDS)}")
    # A device per login: the shared account links one per client at set-up and per round.
    if args.clients * (args.rounds + 1) > MAX_DEVICES:
        sys.exit(
            f"--clients x (--rounds + 1) is {args.clients * (args.rounds + 1)} devices on the "
            f"shared account: home allows {MAX_DEVICES} at most (LCHAT_HOME_MAX_DEVICES)"
        )
    if not 0 < args.vault_bytes <= 18 * 1024:
        sys.exit("--vault-bytes: 1 to 18432 (home's cap)")
    # Twisted's asyncio reactor on this loop: the clients are asyncio, the anchor's S3Store is
    # Twisted, and both run here.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    from twisted.internet import asyncioreactor

    asyncioreactor.install(loop)
    from twisted.internet import reactor as installed

    reactor: Any = installed
    try:
        import tests.s3servers  # noqa: F401  (it imports the reactor: after the install)
    except ImportError as e:
        sys.exit(f"{e}: bench/home.py needs the test extras (boto3, moto, seaweedfs)")
    info = benchlib.machine()
    started = time.monotonic()
    outcome: list[Any] = []
    servers: list[Any] = []
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        try:

            async def run_all() -> None:
                try:
                    results = []
                    for kind in backends:
                        try:
                            results.append(
                                await bench_backend(reactor, kind, args, tmp, procs, servers)
                            )
                        finally:
                            for server in servers:
                                server.destroy_sync()  # idempotent; frees the CPU it spins on
                    outcome.append(results)
                except BaseException as e:  # re-raised below, outside the reactor
                    outcome.append(e)
                finally:
                    reactor.stop()

            tasks: list[asyncio.Task[None]] = []
            reactor.callWhenRunning(lambda: tasks.append(loop.create_task(run_all())))
            reactor.run(installSignalHandlers=False)
        finally:
            for server in servers:
                server.destroy_sync()
    if not outcome or isinstance(outcome[0], BaseException):
        raise outcome[0] if outcome else RuntimeError("the benchmark did not finish")
    text = report(args, info, outcome[0], time.monotonic() - started)
    print(text)
    OUT.write_text(text + "\n")
    log(f"wrote {OUT}")


if __name__ == "__main__":
    main()

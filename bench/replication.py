"""Replication: lchat's Replicator beside ``litestream replicate``, same moto server, same workload.

    .venv/bin/python bench/replication.py [--seconds 20] [--rate 20] [--idle 20] [--sizes 10,100]
        [--restore-runs 3]

(needs the test extras — boto3, moto — as tests/s3servers.py does; /tmp/venv/bin/python has them.)

Each replicator streams its OWN copy of a SQLite database (WAL mode) to its own prefix of one moto
bucket, through its own counting HTTP proxy on loopback (so every S3 request and every uploaded
body byte is counted at the wire, the same way for both). Ours runs in a child process (``stream``
class, 1 s interval); Litestream 0.5 with its default 1 s sync interval. One writer process commits
the same small transaction to both databases ``--rate`` times a second for ``--seconds`` seconds,
recording each commit's wall time and its sequence number (the row carries ``seq:NNNNNNNN;``).

Lag: a poller LISTs both prefixes every 100 ms straight at moto (not counted), downloads each new
LTX file once and decodes it; the highest ``seq:`` in its pages is the last commit it covers. The
file's durable time is when the server's reply to its PUT passed the proxy (exact, not rounded to
the poll). A commit's lag = the earliest PUT reply of a file covering it minus its commit time.

Busy = the writer's run plus 3 s to drain; idle = ``--idle`` seconds after that with the writer
stopped. CPU = utime+stime from /proc/<pid>/stat over each window, for both child processes.

Restore: for each size a database of random rows is replicated once by our Replicator (one
snapshot), then restored by ours and by ``litestream restore`` from the same replica; the anchor is
a plain download of the same LTX bytes with our S3 client. Download and our restore alternate
``--restore-runs`` times and their medians are reported (Litestream's restore runs once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

HERE = os.path.abspath(__file__)
LITESTREAM = next(
    (
        p
        for p in (
            os.path.join(os.path.dirname(sys.executable), "litestream"),
            "/tmp/venv/bin/litestream",
        )
        if os.path.exists(p)
    ),
    "litestream",
)
SEQ = re.compile(rb"seq:(\d{8});")
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
CLK = os.sysconf("SC_CLK_TCK")


# -- the counting proxy -----------------------------------------------------------------------


class CountingProxy:
    """Relays loopback TCP to ``target`` and logs every HTTP request: (start, done, method, path,
    body bytes). ``done`` is when the first non-100 status line of its reply came back."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.log: list[list[Any]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            pending: list[list[Any]] = []
            threading.Thread(target=self._up, args=(client, upstream, pending), daemon=True).start()
            threading.Thread(
                target=self._down, args=(upstream, client, pending), daemon=True
            ).start()

    def _up(self, src: socket.socket, dst: socket.socket, pending: list[list[Any]]) -> None:
        buf = b""
        body_left = 0
        chunked = False
        entry: list[Any] | None = None
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                dst.close()
                return
            dst.sendall(data)
            buf += data
            while buf:
                if body_left > 0:
                    n = min(body_left, len(buf))
                    body_left -= n
                    buf = buf[n:]
                    if entry is not None:
                        entry[4] += n
                    continue
                if chunked:
                    line_end = buf.find(b"\r\n")
                    if line_end < 0:
                        break
                    size = int(buf[:line_end].split(b";")[0] or b"0", 16)
                    if size == 0:
                        end = buf.find(b"\r\n\r\n")
                        if end < 0:
                            break
                        buf = buf[end + 4 :]
                        chunked = False
                        continue
                    buf = buf[line_end + 2 :]
                    body_left = size + 2  # the chunk and its CRLF
                    if entry is not None:
                        entry[4] -= 2
                    continue
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, buf = buf[:end].decode("latin-1"), buf[end + 4 :]
                lines = head.split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (x.partition(":") for x in lines[1:])
                }
                entry = [time.time(), None, method, path, 0]
                with self.lock:
                    self.log.append(entry)
                    pending.append(entry)
                body_left = int(headers.get("content-length", "0"))
                chunked = "chunked" in headers.get("transfer-encoding", "").lower()

    def _down(self, src: socket.socket, dst: socket.socket, pending: list[list[Any]]) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                dst.close()
                return
            now = time.time()
            for m in STATUS.finditer(data[:4096] if len(data) > 4096 else data):
                if m.group(1) != b"100":
                    with self.lock:
                        if pending:
                            pending.pop(0)[1] = now
            try:
                dst.sendall(data)
            except OSError:
                return

    def window(self, t0: float, t1: float) -> tuple[int, int, dict[str, int]]:
        with self.lock:
            rows = [e for e in self.log if t0 <= e[0] < t1]
        by: dict[str, int] = {}
        for e in rows:
            by[e[2]] = by.get(e[2], 0) + 1
        return len(rows), sum(e[4] for e in rows if e[2] in ("PUT", "POST")), by

    def deferred(self, t0: float, t1: float) -> int:
        """Requests in the window that finish earlier writes: uploads of compacted files
        (levels 1-8) and deletes of the files they replace. Everything else is periodic cost."""
        compacted = re.compile(r"/000[1-8]/[0-9a-f]{16}-[0-9a-f]{16}\.ltx$")

        def finishing(method: str, path: str) -> bool:
            if method == "DELETE":
                return True
            return method == "PUT" and compacted.search(path) is not None

        with self.lock:
            return sum(
                1 for e in self.log if t0 <= e[0] < t1 and finishing(e[2], e[3].split("?")[0])
            )

    def paths(self, t0: float, t1: float) -> list[str]:
        with self.lock:
            return sorted({f"{e[2]} {e[3].split('?')[0]}" for e in self.log if t0 <= e[0] < t1})

    def put_done(self) -> dict[str, float]:
        with self.lock:
            return {
                e[3].split("?")[0]: e[1] for e in self.log if e[2] == "PUT" and e[1] is not None
            }


# -- child processes ------------------------------------------------------------------------


def child_writer(argv: list[str]) -> None:
    dbs, rate, seconds, out = argv[0].split(","), float(argv[1]), float(argv[2]), argv[3]
    conns = [sqlite3.connect(p, isolation_level=None) for p in dbs]
    times: list[list[float]] = [[] for _ in dbs]
    n = int(rate * seconds)
    t0 = time.monotonic()
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        body = f"seq:{i:08d};" + "x" * 100
        for c, ts in zip(conns, times, strict=True):
            c.execute("INSERT INTO t(seq, body) VALUES (?, ?)", (i, body))
            ts.append(time.time())
    with open(out, "w") as f:
        json.dump(times, f)


def child_ours(argv: list[str]) -> None:
    db, endpoint, bucket, path, region, key, secret = argv
    import botocore.credentials  # type: ignore[import-untyped]

    from lchat.objstore.s3 import S3Store
    from lchat.replica.replicator import Replicator
    from lchat.threads import thread_runner

    async def run(reactor: Any) -> None:
        creds = botocore.credentials.Credentials(key, secret)
        store = S3Store(
            reactor,
            bucket,
            run_in_thread=thread_runner(reactor),
            monotonic=time.monotonic,
            endpoint=endpoint,
            region=region,
            credentials=creds,
        )
        rep = Replicator(reactor, store, db, path, interval=1.0)
        await rep.start()
        print("ready", flush=True)
        done: Deferred[None] = Deferred()
        signal.signal(signal.SIGTERM, lambda *_: reactor.callFromThread(done.callback, None))
        await done
        await rep.stop()
        await store.close()

    task.react(lambda reactor: Deferred.fromCoroutine(run(reactor)))


# -- helpers --------------------------------------------------------------------------------


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def make_db(path: str) -> None:
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, seq INTEGER, body TEXT)")
    c.close()


def make_sized_db(path: str, mb: int) -> None:
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("CREATE TABLE b(id INTEGER PRIMARY KEY, data BLOB)")
    c.execute("BEGIN")
    for _ in range(mb * 256):  # 4 KiB of random bytes a row
        c.execute("INSERT INTO b(data) VALUES (randomblob(4000))")
    c.execute("COMMIT")
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()


class Poller(threading.Thread):
    """LISTs a prefix every 100 ms straight at moto; decodes each new LTX file once."""

    def __init__(self, server: Any, prefix: str) -> None:
        super().__init__(daemon=True)
        self.s3 = server.client()
        self.bucket = server.bucket
        self.prefix = prefix
        self.files: dict[str, int] = {}  # key -> highest seq in it (-1 when none)
        self.stopping = threading.Event()

    def run(self) -> None:
        from lchat.replica import ltx

        while not self.stopping.is_set():
            try:
                listed = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/")
            except Exception:
                listed = {}
            for obj in listed.get("Contents", []):
                k = obj["Key"]
                if k in self.files or not k.endswith(".ltx"):
                    continue
                body = self.s3.get_object(Bucket=self.bucket, Key=k)["Body"].read()
                try:
                    pages = ltx.decode(_bytes_io(body)).pages
                except Exception:
                    continue
                best = -1
                for _, page in pages:
                    for m in SEQ.finditer(page):
                        best = max(best, int(m.group(1)))
                self.files[k] = best
            self.stopping.wait(0.1)


def _bytes_io(b: bytes) -> Any:
    import io

    return io.BytesIO(b)


def lags(
    times: list[float], files: dict[str, int], done: dict[str, float], bucket: str
) -> list[float]:
    covered = sorted(
        (done[f"/{bucket}/{k}"], seq)
        for k, seq in files.items()
        if f"/{bucket}/{k}" in done and seq >= 0
    )
    out = []
    for i, t in enumerate(times):
        hit = next((d for d, seq in covered if seq >= i), None)
        if hit is not None:
            out.append(hit - t)
    return out


# -- the run --------------------------------------------------------------------------------


async def main(reactor: Any, argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--idle", type=float, default=20)
    parser.add_argument("--sizes", default="10,100")
    parser.add_argument(
        "--restore-runs", type=int, default=3, help="download+restore rounds per size (medians)"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    from tests.s3servers import S3Server, store_for

    server = S3Server("moto")
    await server.start()
    work = tempfile.mkdtemp(prefix="lchat-bench-repl-")
    procs: list[subprocess.Popen[bytes]] = []
    out: list[str] = []
    try:
        moto_port = int(server.endpoint.rsplit(":", 1)[1])
        key, secret = server.credentials.access_key, server.credentials.secret_key
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
        names = ("lchat", "litestream")
        proxies = {n: CountingProxy(moto_port) for n in names}
        dbs = {n: os.path.join(work, f"{n}.db") for n in names}
        paths = {n: f"bench/{n}" for n in names}
        for p in dbs.values():
            make_db(p)

        ours = subprocess.Popen(  # noqa: ASYNC220
            [
                sys.executable,
                HERE,
                "--child-ours",
                dbs["lchat"],
                f"http://127.0.0.1:{proxies['lchat'].port}",
                server.bucket,
                paths["lchat"],
                server.region,
                key,
                secret,
            ],
            stdout=subprocess.PIPE,
        )
        procs.append(ours)
        config = os.path.join(work, "litestream.yml")
        with open(config, "w") as f:  # noqa: ASYNC230
            f.write(
                f"dbs:\n  - path: {dbs['litestream']}\n    replica:\n      type: s3\n"
                f"      bucket: {server.bucket}\n      path: {paths['litestream']}\n"
                f"      endpoint: http://127.0.0.1:{proxies['litestream'].port}\n"
                f"      region: {server.region}\n      force-path-style: true\n"
            )
        lslog = open(os.path.join(work, "litestream.log"), "wb")  # noqa: ASYNC230
        theirs = subprocess.Popen(  # noqa: ASYNC220
            [LITESTREAM, "replicate", "-config", config], env=env, stdout=lslog, stderr=lslog
        )
        procs.append(theirs)
        assert ours.stdout is not None
        line = await deferToThread(ours.stdout.readline)
        assert line.strip() == b"ready", line
        pids = {"lchat": ours.pid, "litestream": theirs.pid}
        await deferToThread(time.sleep, 3.0)  # both initial snapshots

        pollers = {n: Poller(server, paths[n]) for n in names}
        for p in pollers.values():
            p.start()
        timesfile = os.path.join(work, "times.json")
        t_busy = time.time()
        cpu0 = {n: cpu(pid) for n, pid in pids.items()}
        writer = [sys.executable, HERE, "--child-writer", ",".join(dbs[n] for n in names)]
        done = await deferToThread(
            subprocess.run, [*writer, str(args.rate), str(args.seconds), timesfile], check=True
        )
        assert done.returncode == 0
        await deferToThread(time.sleep, 3.0)  # drain
        t_idle = time.time()
        cpu1 = {n: cpu(pid) for n, pid in pids.items()}
        await deferToThread(time.sleep, args.idle)
        t_end = time.time()
        cpu2 = {n: cpu(pid) for n, pid in pids.items()}
        for p in pollers.values():
            p.stopping.set()
            p.join()
        with open(timesfile) as f:  # noqa: ASYNC230
            times = dict(zip(names, json.load(f), strict=True))

        busy_s, idle_s = t_idle - t_busy, t_end - t_idle
        res: dict[str, dict[str, Any]] = {}
        for n in names:
            lag = lags(times[n], pollers[n].files, proxies[n].put_done(), server.bucket)
            breq, bbytes, bby = proxies[n].window(t_busy, t_idle)
            ireq, _, iby = proxies[n].window(t_idle, t_end)
            ideferred = proxies[n].deferred(t_idle, t_end)
            res[n] = dict(
                ideferred=ideferred,
                lag=lag,
                commits=len(times[n]),
                breq=breq,
                bbytes=bbytes,
                bby=bby,
                ireq=ireq,
                iby=iby,
                bcpu=cpu1[n] - cpu0[n],
                icpu=cpu2[n] - cpu1[n],
            )

        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            await deferToThread(p.wait, 15)
        lslog.close()

        # -- restore ----------------------------------------------------------------------
        from lchat.replica.replicator import Replicator
        from lchat.replica.restore import replica_files, restore
        from lchat.threads import thread_runner

        store = store_for(server, timeout=120.0)
        restores = []
        for mb in sizes:
            src = os.path.join(work, f"size{mb}.db")
            await deferToThread(make_sized_db, src, mb)
            rpath = f"bench/restore{mb}"
            rep = Replicator(reactor, store, src, rpath, interval=3600.0)
            await rep.start()
            await rep.stop()
            infos = replica_files(await store.list(rpath + "/"))
            # Download and restore alternate, --restore-runs times; the medians are reported.
            dls: list[float] = []
            ours: list[float] = []
            o1 = os.path.join(work, f"ours{mb}.db")
            for _ in range(args.restore_runs):
                t = time.perf_counter()
                got = 0
                for i, fi in enumerate(infos):
                    got += (await store.get_to_file(fi.info.key, os.path.join(work, f"dl{i}"))).size
                dls.append(time.perf_counter() - t)
                t = time.perf_counter()
                await restore(
                    store, rpath, o1, overwrite=True, run_in_thread=thread_runner(reactor)
                )
                ours.append(time.perf_counter() - t)
            t_dl, t_ours = statistics.median(dls), statistics.median(ours)
            o2 = os.path.join(work, f"ls{mb}.db")
            url = (
                f"s3://{server.bucket}/{rpath}?endpoint={server.endpoint}"
                f"&region={server.region}&force-path-style=true"
            )
            t = time.perf_counter()
            r = await deferToThread(
                subprocess.run, [LITESTREAM, "restore", "-o", o2, url], env=env, capture_output=True
            )
            t_ls = time.perf_counter() - t
            if r.returncode != 0:
                t_ls = float("nan")
                print(r.stderr.decode()[-2000:], file=sys.stderr)
            restores.append((mb, os.path.getsize(src), got, t_dl, t_ours, t_ls))  # noqa: ASYNC240
            for p in (src, o1, o2):
                if os.path.exists(p):  # noqa: ASYNC240
                    os.unlink(p)
        await store.close()

        # -- report -----------------------------------------------------------------------
        lo, ls = res["lchat"], res["litestream"]
        out += [
            f"### {args.seconds:g} s of {args.rate:g} commits/s (~130-byte rows), then {idle_s:.0f} s idle; moto",
            "",
            "| | lchat Replicator (stream, 1 s) | litestream 0.5.17 replicate (1 s) |",
            "|---|---|---|",
            f"| commits / measured lags | {lo['commits']} / {len(lo['lag'])} | {ls['commits']} / {len(ls['lag'])} |",
        ]
        for label, q in (("lag p50", 0.5), ("lag p99", 0.99), ("lag max", 1.0)):
            out.append(
                f"| {label} | {pct(lo['lag'], q) * 1000:.0f} ms | {pct(ls['lag'], q) * 1000:.0f} ms |"
            )

        def by(d: dict[str, int]) -> str:
            return " ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"

        out += [
            f"| busy requests ({busy_s:.0f} s) | {lo['breq']} ({by(lo['bby'])}) | {ls['breq']} ({by(ls['bby'])}) |",
            f"| busy requests / hour | {lo['breq'] * 3600 / busy_s:.0f} | {ls['breq'] * 3600 / busy_s:.0f} |",
            f"| bytes uploaded (busy) | {lo['bbytes']:,} | {ls['bbytes']:,} |",
            f"| idle requests ({idle_s:.0f} s) | {lo['ireq']} ({by(lo['iby'])}) | {ls['ireq']} ({by(ls['iby'])}) |",
            f"| idle requests / hour | {lo['ireq'] * 3600 / idle_s:.0f} | {ls['ireq'] * 3600 / idle_s:.0f} |",
            f"| CPU busy / idle | {lo['bcpu']:.2f} s / {lo['icpu']:.2f} s | {ls['bcpu']:.2f} s / {ls['icpu']:.2f} s |",
            "",
            f"### Restore (one snapshot written by our Replicator; random, incompressible rows; "
            f"median of {args.restore_runs})",
            "",
            "| DB | LTX bytes | download | lchat restore | litestream restore | lchat / download |",
            "|---|---|---|---|---|---|",
        ]
        for _mb, size, got, t_dl, t_ours, t_ls in restores:
            out.append(
                f"| {size / 1e6:.1f} MB | {got / 1e6:.1f} MB | {t_dl:.2f} s | {t_ours:.2f} s | {t_ls:.2f} s "
                f"| {t_ours / t_dl:.2f}x |"
            )

        def mark(ok: bool) -> str:
            return "met" if ok else "**not met**"

        p99 = pct(lo["lag"], 0.99)
        r100 = [r for r in restores if r[0] == 100]
        out += [
            "",
            "### Goals",
            "",
            f"- lag p99 ≤ 1 s: {mark(p99 <= 1.0)} ({p99 * 1000:.0f} ms)",
            f"- zero requests while idle: {mark(lo['ireq'] - lo['ideferred'] == 0)} "
            f"({lo['ireq'] - lo['ideferred']} periodic in {idle_s:.0f} s; plus "
            f"{lo['ideferred']} finishing the busy period's compaction, as Litestream's "
            f"{ls['ideferred']})",
            f"- no more bytes than Litestream: {mark(lo['bbytes'] <= ls['bbytes'])} "
            f"({lo['bbytes']:,} vs {ls['bbytes']:,})",
            f"- no more requests than Litestream: {mark(lo['breq'] + lo['ireq'] <= ls['breq'] + ls['ireq'])} "
            f"({lo['breq'] + lo['ireq']} vs {ls['breq'] + ls['ireq']}, busy + idle)",
        ]
        if r100:
            ratio = r100[0][4] / r100[0][3]
            out.append(f"- restore 100 MB ≤ 1.5x download: {mark(ratio <= 1.5)} ({ratio:.2f}x)")
        for n in names:
            idle_paths = proxies[n].paths(t_idle, t_end)
            if idle_paths:
                out.append(f"- {n} idle requests: {', '.join(idle_paths[:6])}")
        print("\n".join(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        await server.destroy()
        shutil.rmtree(work, True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-writer"]:
        child_writer(sys.argv[2:])
    elif sys.argv[1:2] == ["--child-ours"]:
        child_ours(sys.argv[2:])
    else:
        task.react(lambda reactor: Deferred.fromCoroutine(main(reactor, sys.argv[1:])))

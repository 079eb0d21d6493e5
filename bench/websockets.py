"""1,000 concurrent WebSockets through the router, nginx as the anchor: RSS per connection.

The backend (bench/backend.py, unix socket) echoes every frame on ``GET /ws``. The client opens
``--connections`` WebSockets through the proxy (at most ``--open-concurrency`` handshakes at a
time, so a listen backlog is not what we measure), sends ``--messages`` text frames on each and
checks every echo, then holds them all open and reads the proxy's RSS: the router process, nginx's
worker. RSS per connection = (RSS with all open - RSS before) / connections open.

A proxy that answers the upgrade with anything but 101 is reported as such and skipped.

Goal (issue 15): the router's RSS per connection at most nginx's (``GOAL_RSS_RATIO``), both
measured in the same run, every WebSocket open and echoing.

    .venv/bin/python bench/websockets.py [--connections 1000] [--router-rev REV]

(Named after what it measures; run it as a script, never import it as ``websockets``.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import benchlib
from backend import WS_GUID, encode_frame
from benchlib import HOST, log

GOAL_RSS_RATIO = 1.0  # router RSS per connection <= nginx's worker's


class HandshakeRefused(Exception):
    def __init__(self, status: int, head: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.head = head


@dataclass
class Stats:
    expected: int
    opened: int = 0
    failed: int = 0
    close_errors: int = 0  # open and echoing, then broken while held or at the close
    errors: dict[str, int] = field(default_factory=dict)
    handshake_ms: list[float] = field(default_factory=list)
    echo_ms: list[float] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # every client open or failed

    def open(self) -> None:
        self.opened += 1
        self._check()

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1
        self._check()

    def _check(self) -> None:
        if self.opened + self.failed >= self.expected:
            self.settled.set()


async def connect(port: int, limit: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a WebSocket (RFC 6455 handshake); raises HandshakeRefused on a non-101."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), limit)
    key = base64.b64encode(os.urandom(16))
    writer.write(
        b"GET /ws HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: " + key + b"\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limit)
    status = int(head.split(b" ", 2)[1])
    if status != 101:
        writer.close()
        raise HandshakeRefused(status, head.decode("latin-1").split("\r\n")[0])
    accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
    if accept.lower() not in head.lower():
        writer.close()
        raise ValueError("wrong Sec-WebSocket-Accept")
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first, second = await reader.readexactly(2)
    length = second & 0x7F
    if length == 126:
        length = int.from_bytes(await reader.readexactly(2), "big")
    elif length == 127:
        length = int.from_bytes(await reader.readexactly(8), "big")
    if second & 0x80:  # servers never mask, but do not choke on it
        await reader.readexactly(4)
    return first & 0x0F, await reader.readexactly(length)


async def one_client(
    n: int,
    port: int,
    args: argparse.Namespace,
    gate: asyncio.Semaphore,
    hold: asyncio.Event,
    stats: Stats,
) -> None:
    async with gate:
        t0 = time.perf_counter()
        try:
            reader, writer = await connect(port, args.timeout)
        except HandshakeRefused as e:
            stats.fail(f"handshake answered {e.head}")
            return
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
            stats.fail(f"handshake: {type(e).__name__} {e}")
            return
        stats.handshake_ms.append((time.perf_counter() - t0) * 1000)
    phase = "echo"
    try:
        for i in range(args.messages):
            payload = f"{n}:{i}:".encode().ljust(args.size, b"x")
            t0 = time.perf_counter()
            writer.write(encode_frame(0x81, payload, mask=os.urandom(4)))
            opcode, echoed = await asyncio.wait_for(read_frame(reader), args.timeout)
            if opcode != 0x1 or echoed != payload:
                raise ValueError("echo differs")
            stats.echo_ms.append((time.perf_counter() - t0) * 1000)
        stats.open()
        phase = "close"
        await hold.wait()  # every socket stays open until RSS has been read
        writer.write(encode_frame(0x88, (1000).to_bytes(2, "big"), mask=os.urandom(4)))
        opcode, _ = await asyncio.wait_for(read_frame(reader), args.timeout)
        if opcode != 0x8:
            raise ValueError(f"opcode {opcode} instead of close")
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
        why = f"{phase}: {type(e).__name__} {e}"
        if phase == "echo":
            stats.fail(why)
        else:  # it was open and echoing: it broke while held, or the close went wrong
            stats.errors[why] = stats.errors.get(why, 0) + 1
            stats.close_errors += 1
    finally:
        writer.close()


async def measure(
    name: str, port: int, rss_pid: int, args: argparse.Namespace
) -> dict[str, object]:
    # One probe first: a proxy that cannot upgrade gets one clear line, not 1,000 failures.
    try:
        _, writer = await connect(port, args.timeout)
        writer.close()
    except HandshakeRefused as e:
        return {"refused": f"answered the upgrade with `{e.head}`"}
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
        return {"refused": f"handshake failed: {type(e).__name__} {e}"}
    await asyncio.sleep(0.5)
    before = benchlib.proc_status(rss_pid, "VmRSS")
    benchlib.reset_peak_rss(rss_pid)
    stats, hold = Stats(args.connections), asyncio.Event()
    gate = asyncio.Semaphore(args.open_concurrency)
    t0 = time.perf_counter()
    tasks = [
        asyncio.create_task(one_client(n, port, args, gate, hold, stats))
        for n in range(args.connections)
    ]
    # Wait until every client has either echoed (and is holding) or failed.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stats.settled.wait(), args.timeout + args.connections * 0.05)
    setup = time.perf_counter() - t0
    await asyncio.sleep(args.hold)
    open_rss = benchlib.proc_status(rss_pid, "VmRSS")
    peak = benchlib.proc_status(rss_pid, "VmHWM")
    log(f"{name}: {stats.opened} open, {stats.failed} failed, RSS {before} -> {open_rss} KiB")
    hold.set()
    await asyncio.wait(tasks, timeout=args.timeout)
    for task in tasks:
        task.cancel()
    await asyncio.sleep(1)
    after = benchlib.proc_status(rss_pid, "VmRSS")
    return {
        "stats": stats,
        "setup": setup,
        "before": before,
        "open": open_rss,
        "peak": peak,
        "after": after,
    }


def pct(values: list[float], q: int) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.quantiles(values, n=100)[q - 1]:.1f}"


def report_row(name: str, r: dict[str, object], connections: int) -> list[str]:
    if "refused" in r:
        return [name, f"not measured: {r['refused']}", *["-"] * 7]
    s = r["stats"]
    assert isinstance(s, Stats)
    before, opened = int(str(r["before"])), int(str(r["open"]))
    per = f"{(opened - before) / s.opened:.1f} KiB" if s.opened else "-"
    bad = s.failed + s.close_errors
    failed = f"{bad} ({'; '.join(f'{k}: {v}' for k, v in s.errors.items())})"
    return [
        name,
        f"{s.opened}/{connections}",
        failed if bad else "0",
        f"{pct(s.handshake_ms, 50)} / {pct(s.handshake_ms, 99)} ms",
        f"{pct(s.echo_ms, 50)} / {pct(s.echo_ms, 99)} ms",
        benchlib.mib(before),
        benchlib.mib(opened),
        per,
        benchlib.mib(int(str(r["after"]))),
    ]


def per_connection(r: dict[str, object]) -> float | None:
    """KiB of RSS per open WebSocket: (RSS all open - RSS before) / open; None if none opened."""
    if "refused" in r:
        return None
    s = r["stats"]
    assert isinstance(s, Stats)
    if not s.opened:
        return None
    return (int(str(r["open"])) - int(str(r["before"]))) / s.opened


def goal_line(results: dict[str, dict[str, object]], connections: int) -> str:
    """The router's RSS per connection against nginx's, and whether the goal is met."""
    n, r = per_connection(results["nginx"]), per_connection(results["router"])
    if n is None or r is None:
        return "- RSS per connection: not judged (a proxy opened no WebSocket)"
    ratio = r / n if n > 0 else float("inf")
    failures = []
    for name, result in results.items():
        s = result["stats"]
        assert isinstance(s, Stats)
        if s.opened < connections or s.close_errors:
            failures.append(f"{name} {s.opened}/{connections} open, {s.close_errors} broken")
    if failures:
        verdict = f"not judged: {'; '.join(failures)}"
    else:
        verdict = "**met**" if ratio <= GOAL_RSS_RATIO else "**NOT met**"
    return (
        f"- {connections} WebSockets, RSS per connection: router **{r:.1f} KiB**, nginx's worker "
        f"{n:.1f} KiB, router/nginx **{ratio:.2f}x** (goal ≤ {GOAL_RSS_RATIO:g}x): {verdict}"
    )


async def run_all(
    targets: dict[str, tuple[int, int]], args: argparse.Namespace
) -> dict[str, dict[str, object]]:
    results = {}
    for name, (port, rss_pid) in targets.items():
        log(f"{name}: {args.connections} WebSockets")
        r = await measure(name, port, rss_pid, args)
        if "refused" in r:
            log(f"{name}: {r['refused']}")
        results[name] = r
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="concurrent WebSockets through nginx and router")
    parser.add_argument("--connections", type=int, default=1000, help="WebSockets (1000)")
    parser.add_argument("--messages", type=int, default=3, help="echoes per socket (3)")
    parser.add_argument("--size", type=int, default=64, help="message bytes (64)")
    parser.add_argument("--open-concurrency", type=int, default=50, help="handshakes at once")
    parser.add_argument("--hold", type=float, default=2, help="seconds all stay open before RSS")
    parser.add_argument("--timeout", type=float, default=30, help="seconds per step")
    parser.add_argument("--router-rev", metavar="REV", help="run this git commit of the router")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = parser.parse_args()

    benchlib.ensure_tools(["nginx"])
    nofile = benchlib.raise_nofile()
    if nofile < 2 * args.connections + 100:
        sys.exit(f"open-files limit {nofile} is too low for {args.connections} WebSockets")
    info = benchlib.machine()
    info["router"] = benchlib.router_label(args.router_rev)
    with benchlib.workspace(args.keep) as (tmp, procs):
        backend = benchlib.start_backend(procs, tmp)
        nginx_port, nginx = benchlib.start_nginx(procs, tmp, {HOST: backend})
        router_port, router = benchlib.start_router(
            procs, tmp, {HOST: backend}, rev=args.router_rev
        )
        info["reactor"] = benchlib.router_reactor(procs, "router", router.pid)
        targets = {
            "nginx": (nginx_port, benchlib.nginx_worker(nginx)),
            "router": (router_port, router.pid),
        }
        results = asyncio.run(run_all(targets, args))
        procs.check_alive()
    rows = [report_row(name, r, args.connections) for name, r in results.items()]

    print()
    print("## websockets")
    print()
    print(benchlib.machine_markdown(info))
    print(
        f"- {args.connections} WebSockets to bench/backend.py's echo (unix socket), "
        f"{args.messages} x {args.size}-byte text messages each, {args.open_concurrency} "
        "handshakes at a time, all held open while RSS is read"
    )
    print(
        "- RSS: the router process, nginx's one worker, read from /proc in the same run (nginx "
        "first, then the router); per connection = (RSS all open - RSS before) / open"
    )
    print()
    print("### Goal (router ÷ nginx, same run)")
    print()
    print(goal_line(results, args.connections))
    print()
    headers = [
        "proxy",
        "open",
        "failed",
        "handshake p50 / p99",
        "echo p50 / p99",
        "RSS before",
        "RSS all open",
        "RSS per connection",
        "RSS after close",
    ]
    print(benchlib.table(headers, rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

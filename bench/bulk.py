"""Bulk transfer: a 1 GiB download and a 1 GiB upload through the router, nginx as the anchor.

The backend (bench/backend.py, unix socket) streams zeros for ``GET /big?bytes=N`` and counts the
body of ``POST /upload``. The client is curl (``-o /dev/null`` down; ``-T`` a sparse file up), so
nothing holds a gigabyte in memory on the client side. For each proxy it reports MB/s (10^6
bytes/s), the proxy's CPU, and its RSS before and at peak during each transfer: the router's own
process, nginx's worker. The peak is VmHWM after resetting it (``/proc/<pid>/clear_refs``), and
VmRSS sampled every 20 ms as a cross-check.

Goals (issue 15): the router moves 1 GiB each way at >= 0.8x nginx's MB/s (medians of the same
run), in constant memory: its peak RSS at most ``RSS_GROWTH_BOUND_MIB`` above its RSS before the
transfer (a proxy holding the body would grow by up to the whole transfer), and no higher in the
second half of the transfer than in the first (``RSS_LATE_GROWTH_MIB`` of slack): memory that
does not grow with the bytes moved.

    .venv/bin/python bench/bulk.py [--size-mib 1024] [--rounds 1] [--router-rev REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchlib
from benchlib import HOST, log

GOAL_MBPS = 0.8  # router MB/s >= 0.8 x nginx's, each direction
RSS_GROWTH_BOUND_MIB = 32  # the router's peak RSS - its RSS before a transfer, at most
RSS_LATE_GROWTH_MIB = 4  # its RSS in the second half of a transfer - its peak in the first half


class PeakRSS:
    """Samples a process's VmRSS in a thread; ``peak`` also trusts the kernel's VmHWM."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.sampled = 0
        self.samples: list[tuple[float, int]] = []  # (monotonic time, VmRSS KiB)
        self.hwm_reset = benchlib.reset_peak_rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = benchlib.proc_status(self.pid, "VmRSS")
            self.samples.append((time.monotonic(), rss))
            self.sampled = max(self.sampled, rss)

    @property
    def late_growth(self) -> int:
        """KiB by which the RSS sampled in the second half of the transfer exceeds the peak of
        the first half (0 or less: it did not grow with the bytes moved). 0 with < 4 samples."""
        if len(self.samples) < 4:
            return 0
        middle = (self.samples[0][0] + self.samples[-1][0]) / 2
        first = [rss for t, rss in self.samples if t <= middle]
        second = [rss for t, rss in self.samples if t > middle]
        return max(second) - max(first) if first and second else 0

    @property
    def peak(self) -> int:
        hwm = benchlib.proc_status(self.pid, "VmHWM") if self.hwm_reset else 0
        return max(hwm, self.sampled)


STALL_SECONDS = 20  # nothing moving for this long (a proxy that stopped reading): give up


def curl(argv: list[str], timeout: float) -> tuple[int, int, float, str]:
    """(HTTP status, bytes moved, seconds, error) of one curl run."""
    base = ["curl", "-sS", "--max-time", str(int(timeout)), "-H", f"Host: {HOST}"]
    base += ["--speed-limit", "1", "--speed-time", str(STALL_SECONDS)]
    done = subprocess.run(base + argv, capture_output=True, text=True, timeout=timeout + 30)
    error = done.stderr.strip()
    try:
        code, size, seconds = done.stdout.split()[-3:]
        return int(code), int(float(size)), float(seconds), error
    except ValueError:
        return 0, 0, 0.0, error or done.stdout.strip() or f"curl exit {done.returncode}"


def transfer(
    direction: str,
    port: int,
    rss_pid: int,
    cpu_pids: list[int],
    backend_pid: int,
    backend_sock: Path,
    size: int,
    upload_file: Path,
    reply_file: Path,
    timeout: float,
) -> dict[str, object]:
    url = f"http://127.0.0.1:{port}"
    if direction == "download":
        argv = ["-o", "/dev/null", "-w", "%{http_code} %{size_download} %{time_total}"]
        argv.append(f"{url}/big?bytes={size}")
    else:
        # -T streams the file with a Content-Length; no "Expect: 100-continue" round trip.
        argv = ["-X", "POST", "-T", str(upload_file), "-H", "Expect:", "-o", str(reply_file)]
        argv += ["-H", "Content-Type: application/octet-stream"]
        argv += ["-w", "%{http_code} %{size_upload} %{time_total}", f"{url}/upload"]
    before = benchlib.proc_status(rss_pid, "VmRSS")
    body0 = benchlib.backend_stats(backend_sock)["body_bytes"]
    cpu0, backend0 = benchlib.cpu_seconds(cpu_pids), benchlib.cpu_seconds([backend_pid])
    with PeakRSS(rss_pid) as peak:
        code, moved, seconds, error = curl(argv, timeout)
    cpu = benchlib.cpu_seconds(cpu_pids) - cpu0
    backend_cpu = benchlib.cpu_seconds([backend_pid]) - backend0
    ok = code == 200 and moved == size
    if ok and direction == "upload":
        try:
            received = json.loads(reply_file.read_text())["received"]
        except (OSError, ValueError, KeyError):
            received = -1
        if received != size:
            ok, error = False, f"the answer says {received} of {size} bytes arrived"
    if not ok:
        error = f"{error or f'HTTP {code}'}; client moved {moved} of {size} bytes"
        if direction == "upload":  # where did the body stop?
            got = benchlib.backend_stats(backend_sock)["body_bytes"] - body0
            error += f", backend received {got}"
    return {
        "ok": ok,
        "error": error,
        "mbps": size / seconds / 1e6 if ok and seconds else 0.0,
        "seconds": seconds,
        "cpu": 100 * cpu / seconds if seconds else 0.0,
        "backend_cpu": 100 * backend_cpu / seconds if seconds else 0.0,
        "before": before,
        "peak": peak.peak,
        "late_growth": peak.late_growth,
        "samples": len(peak.samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="1 GiB down and up through nginx and the router")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per transfer, MiB")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the four transfers")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per transfer")
    parser.add_argument("--router-rev", metavar="REV", help="run this git commit of the router")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = parser.parse_args()
    size = args.size_mib * 1024 * 1024

    benchlib.ensure_tools(["nginx", "curl"])
    info = benchlib.machine()
    info["router"] = benchlib.router_label(args.router_rev)
    rows = []
    results: list[tuple[str, str, dict[str, object]]] = []
    with benchlib.workspace(args.keep) as (tmp, procs):
        backend = benchlib.start_backend(procs, tmp)
        backend_pid = procs.started[-1][1].pid
        nginx_port, nginx = benchlib.start_nginx(procs, tmp, {HOST: backend})
        router_port, router = benchlib.start_router(
            procs, tmp, {HOST: backend}, rev=args.router_rev
        )
        info["reactor"] = benchlib.router_reactor(procs, "router", router.pid)
        upload = tmp / "upload.bin"
        with open(upload, "wb") as f:
            f.truncate(size)  # sparse: zeros from the page cache, no disk written
        targets = {
            "nginx": (nginx_port, benchlib.nginx_worker(nginx), benchlib.proxy_pids(nginx)),
            "router": (router_port, router.pid, [router.pid]),
        }
        # Read the upload file once: the first reader must not pay for filling the page cache.
        with open(upload, "rb") as f:
            while f.read(1 << 20):
                pass
        # Downloads, then uploads; nginx and router alternate, the first one swapping each round.
        runs = [
            (d, n)
            for i in range(args.rounds)
            for d in ("download", "upload")
            for n in (list(targets) if i % 2 == 0 else list(reversed(targets)))
        ]
        for direction, name in runs:
            port, rss_pid, cpu_pids = targets[name]
            log(f"{name}: {direction} {args.size_mib} MiB")
            r = transfer(
                direction,
                port,
                rss_pid,
                cpu_pids,
                backend_pid,
                backend,
                size,
                upload,
                tmp / "reply.json",
                args.timeout,
            )
            log(f"{name}: {direction} " + ", ".join(f"{k}={v}" for k, v in r.items()))
            growth = int(str(r["peak"])) - int(str(r["before"]))
            results.append((name, direction, r))
            rows.append(
                [
                    name,
                    direction,
                    f"{r['mbps']:.0f}" if r["ok"] else f"failed: {r['error']}",
                    f"{r['seconds']:.1f} s",
                    f"{r['cpu']:.0f}%",
                    f"{r['backend_cpu']:.0f}%",
                    benchlib.mib(int(str(r["before"]))),
                    benchlib.mib(int(str(r["peak"]))),
                    benchlib.mib(growth),
                    f"{benchlib.mib(int(str(r['late_growth'])))} ({r['samples']} samples)",
                ]
            )
            procs.check_alive()
        os.unlink(upload)

    print()
    print("## bulk")
    print()
    print(benchlib.machine_markdown(info))
    print(
        f"- transfers: {args.size_mib} MiB each, curl on 127.0.0.1, backend bench/backend.py on "
        "a unix socket; nginx streams both ways (`proxy_buffering off`, "
        "`proxy_request_buffering off`)"
    )
    print(
        "- RSS: the router process, nginx's one worker; peak = max(VmHWM after a reset, "
        "VmRSS sampled every 20 ms); growth = peak - RSS before; 2nd half = the highest RSS "
        "sampled in the second half of the transfer - the highest in the first half"
    )
    print(
        f"- order: downloads, then uploads; each round alternates which proxy goes first; "
        f"{args.rounds} round(s); MB/s = 10^6 bytes/s, medians over the rounds"
    )
    print()
    print("### Goals (router ÷ nginx, same run)")
    print()
    print(summary(results, args.size_mib))
    print()
    headers = [
        "proxy",
        "direction",
        "MB/s",
        "time",
        "proxy CPU",
        "backend CPU",
        "RSS before",
        "peak RSS",
        "growth",
        "2nd half",
    ]
    print(benchlib.table(headers, rows))
    sys.stdout.flush()


def summary(results: list[tuple[str, str, dict[str, object]]], size_mib: int) -> str:
    """Per direction: the median MB/s of each proxy and the ratio against the goal, then whether
    the router stayed in constant memory (every run: growth and second-half growth bounded)."""
    lines = []
    for direction in ("download", "upload"):
        figures: dict[str, tuple[float, int, int, int, int]] = {}
        for name in ("nginx", "router"):
            runs = [r for n, d, r in results if n == name and d == direction]
            good = [float(str(r["mbps"])) for r in runs if r["ok"]]
            growth = max(int(str(r["peak"])) - int(str(r["before"])) for r in runs)
            late = max(int(str(r["late_growth"])) for r in runs)
            mbps = statistics.median(good) if good else 0.0
            figures[name] = (mbps, growth, late, len(runs) - len(good), len(runs))
        n_mbps, n_growth, _, n_fail, n_runs = figures["nginx"]
        r_mbps, r_growth, r_late, r_fail, r_runs = figures["router"]
        what = f"{size_mib} MiB {direction}"
        if r_fail or n_fail:
            failed = [f"router {r_fail} of {r_runs}"] if r_fail else []
            failed += [f"nginx {n_fail} of {n_runs}"] if n_fail else []
            verdict = f"not judged: FAILED transfers ({', '.join(failed)})"
        else:
            verdict = "**met**" if r_mbps >= GOAL_MBPS * n_mbps else "**NOT met**"
        ratio = f"{r_mbps / n_mbps:.2f}x" if n_mbps else "-"
        lines.append(
            f"- {what}: router **{r_mbps:.0f} MB/s**, nginx {n_mbps:.0f} MB/s, router/nginx "
            f"**{ratio}** (goal ≥ {GOAL_MBPS}x): {verdict}"
        )
        bounded = r_growth <= RSS_GROWTH_BOUND_MIB * 1024 and r_late <= RSS_LATE_GROWTH_MIB * 1024
        lines.append(
            f"- {what}, constant memory: router peak RSS growth {benchlib.mib(r_growth)} "
            f"(≤ {RSS_GROWTH_BOUND_MIB} MiB), second half over first half "
            f"{benchlib.mib(r_late)} (≤ {RSS_LATE_GROWTH_MIB} MiB): "
            f"{'**met**' if bounded else '**NOT met**'} (worst of {r_runs} run(s); nginx's "
            f"worker grew {benchlib.mib(n_growth)})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

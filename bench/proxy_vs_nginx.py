"""Small-response throughput and latency: wrk -> nginx -> backend against wrk -> router -> backend.

One run, one session, the two proxies measured alternately (A/B, B/A, ...) against the same backend
on the same unix socket, so that drift of the machine hits both alike. Prints every round, the
medians, and the ratios router/nginx against the goal (throughput >= 0.8x, p99 <= 1.5x).

    .venv/bin/python bench/proxy_vs_nginx.py [--rounds 3] [--duration 10] [--connections 50]

Everything is on 127.0.0.1 and unix sockets in a temp dir; every process started is stopped at the
end. nginx and wrk are installed with apt-get if missing (Debian).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import benchlib
from benchlib import HOST, log

# wrk's summary as one JSON line: exact percentiles (microseconds) instead of parsing its text.
WRK_LUA = """\
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50":%.1f,"p90":%.1f,"p99":%.1f,"max":%.1f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""

GOAL_THROUGHPUT = 0.8  # router req/s >= 0.8 x nginx's
GOAL_P99 = 1.5  # router p99 <= 1.5 x nginx's

# CPU placement with --pin on 2 cores: the proxy alone on one, wrk and the backend on the other.
PIN_PROXY, PIN_REST = "1", "0"


def run_wrk(
    port: int,
    path: str,
    host: str,
    seconds: float,
    connections: int,
    script: Path,
    cpus: str | None,
) -> dict[str, float]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s"]
    argv += ["-H", f"Host: {host}", "-s", str(script), f"http://127.0.0.1:{port}{path}"]
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    for line in done.stdout.splitlines():
        if line.startswith("WRKJSON "):
            result: dict[str, float] = json.loads(line[len("WRKJSON ") :])
            result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
            result["errors"] = sum(
                result[k] for k in ("connect", "read", "write", "status", "timeout")
            )
            return result
    raise RuntimeError(f"wrk printed no summary:\n{done.stdout}\n{done.stderr}")


@dataclass
class Backend:
    pids: list[int]
    stats_socket: Path | None  # bench/backend.py counts its connections; the space does not


def measure(
    name: str,
    port: int,
    pids: list[int],
    backend: Backend,
    args: argparse.Namespace,
    path: str,
    host: str,
    script: Path,
    seconds: float,
) -> dict[str, float]:
    """One wrk run, plus the CPU the proxy and the backend used and how often the proxy dialled."""
    dials0 = counters(backend)
    proxy0, backend0, own0, busy0, t0 = (
        benchlib.cpu_seconds(pids),
        benchlib.cpu_seconds(backend.pids),
        benchlib.own_cpu_seconds(),
        benchlib.busy_cpu_seconds(),
        time.monotonic(),
    )
    result = run_wrk(port, path, host, seconds, args.connections, script, args.wrk_cpus)
    elapsed = time.monotonic() - t0
    proxy = benchlib.cpu_seconds(pids) - proxy0
    back = benchlib.cpu_seconds(backend.pids) - backend0
    own = benchlib.own_cpu_seconds() - own0  # wrk's and ours
    result["proxy_cpu"] = proxy / elapsed * 100
    result["backend_cpu"] = back / elapsed * 100
    # Whatever else ran on the machine meanwhile (other people's tests): it skews the figures.
    busy = benchlib.busy_cpu_seconds() - busy0
    result["other_cpu"] = max(0.0, busy - proxy - back - own) / elapsed * 100
    # New upstream connections during the run: a pool that keeps them all shows ~0.
    result["dials"] = counters(backend) - dials0 if dials0 >= 0 else -1
    log(
        f"{name:6} {result['rps']:9.0f} req/s  p50 {ms(result['p50'])}  p99 {ms(result['p99'])}"
        f"  errors {int(result['errors'])}  proxy CPU {result['proxy_cpu']:.0f}%"
        f"  other CPU {result['other_cpu']:.0f}%"
    )
    return result


def counters(backend: Backend) -> int:
    if backend.stats_socket is None:
        return -1
    return benchlib.backend_stats(backend.stats_socket)["connections"]


def ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def compare(
    label: str,
    path: str,
    host: str,
    targets: dict[str, tuple[int, list[int]]],
    backend: Backend,
    args: argparse.Namespace,
    script: Path,
) -> str:
    """Warm up, then alternate nginx and router for ``args.rounds`` rounds; markdown out."""
    log(f"{label}: warm-up {args.warmup}s each")
    for name, (port, pids) in targets.items():
        measure(name, port, pids, backend, args, path, host, script, args.warmup)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    rows = []
    for round_no in range(1, args.rounds + 1):
        order = list(targets) if round_no % 2 else list(reversed(targets))
        for name in order:
            port, pids = targets[name]
            r = measure(name, port, pids, backend, args, path, host, script, args.duration)
            results[name].append(r)
            rows.append(row(str(round_no), name, r))
            time.sleep(1)  # let the previous run's connections close
    medians = {name: {k: median(runs, k) for k in runs[0]} for name, runs in results.items()}
    for name, m in medians.items():
        rows.append(row("**median**", name, m))
    headers = [
        "round",
        "proxy",
        "req/s",
        "p50",
        "p99",
        "errors",
        "proxy CPU",
        "µs CPU/req",
        "backend CPU",
        "upstream dials",
        "other CPU",
    ]
    text = [f"### {label}", "", benchlib.table(headers, rows), ""]
    if "nginx" in medians and "router" in medians:
        n, r = medians["nginx"], medians["router"]
        tput, p99 = r["rps"] / n["rps"], r["p99"] / n["p99"]
        ok_t, ok_p = tput >= GOAL_THROUGHPUT, p99 <= GOAL_P99
        text += [
            f"- throughput router/nginx: **{tput:.2f}x** (goal ≥ {GOAL_THROUGHPUT}x: "
            f"{'met' if ok_t else 'NOT met'})",
            f"- p99 router/nginx: **{p99:.2f}x** (goal ≤ {GOAL_P99}x: "
            f"{'met' if ok_p else 'NOT met'})",
            f"- p50 router/nginx: {r['p50'] / n['p50']:.2f}x",
            "",
        ]
    return "\n".join(text)


def row(round_no: str, name: str, r: dict[str, float]) -> list[str]:
    return [
        round_no,
        name,
        f"{r['rps']:.0f}",
        ms(r["p50"]),
        ms(r["p99"]),
        str(int(r["errors"])),
        f"{r['proxy_cpu']:.0f}%",
        f"{r['proxy_cpu'] / 100 / r['rps'] * 1e6:.0f}" if r["rps"] else "-",
        f"{r['backend_cpu']:.0f}%",
        f"{r['dials']:.0f}" if r["dials"] >= 0 else "-",
        f"{r['other_cpu']:.0f}%",
    ]


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def profile_router(
    port: int, pid: int, path: str, host: str, args: argparse.Namespace, script: Path, tmp: Path
) -> str:
    """py-spy on the router while wrk loads it: the top functions, by own time and inclusive."""
    py_spy = benchlib.which("py-spy") or str(benchlib.BIN / "py-spy")
    if not Path(py_spy).exists() and benchlib.which("py-spy") is None:
        return "(--profile: py-spy is not installed; `.venv/bin/pip install py-spy`)\n"
    raw = tmp / "router.pyspy.txt"
    seconds = max(5, int(args.duration))
    spy = subprocess.Popen(
        [
            *(py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "250"),
            *("--format", "raw", "--output", str(raw), "--nonblocking"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    run_wrk(port, path, host, seconds, args.connections, script, args.wrk_cpus)
    try:
        _, err = spy.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        return "(py-spy did not finish)\n"
    if not raw.exists():
        return f"(py-spy failed: {err.strip()[-500:]})\n"
    if args.profile_out:
        Path(args.profile_out).write_text(raw.read_text())
    return summarise_profile(raw.read_text())


def summarise_profile(collapsed: str, top: int = 15) -> str:
    """Tables from py-spy's collapsed stacks (``frame;frame;frame count``, outermost first).

    Own time says where the CPU goes (a syscall's cost lands on the Python frame that made it);
    own time by file groups that by layer; inclusive time of lchat's own functions says which of
    our steps costs what (the reactor frames around everything would only say 100%).
    """
    own: dict[str, int] = {}
    by_file: dict[str, int] = {}
    ours: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [shorten(f) for f in stack.split(";")]
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + count
        where = leaf.partition(" (")[2].rstrip(")") or leaf
        by_file[where] = by_file.get(where, 0) + count
        for frame in set(frames):
            if "(lchat/" in frame:
                ours[frame] = ours.get(frame, 0) + count
    if not total:
        return "(py-spy recorded no samples)\n"

    def tab(counts: dict[str, int], what: str) -> str:
        best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        rows = [[f"{100 * c / total:.1f}%", f"`{f}`"] for f, c in best]
        return benchlib.table(["share", what], rows)

    return "\n".join(
        [
            f"py-spy, {total} non-idle samples of the router under the same wrk load.",
            "",
            "Own time by function (where the CPU is):",
            "",
            tab(own, "function"),
            "",
            "Own time by file:",
            "",
            tab(by_file, "file"),
            "",
            "Inclusive time of lchat's functions:",
            "",
            tab(ours, "function"),
            "",
        ]
    )


def shorten(frame: str) -> str:
    """``handle (twisted/web/http.py:123)`` -> ``handle (twisted/web/http.py)``."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where})" if where else name


def main() -> None:
    parser = argparse.ArgumentParser(description="wrk -> nginx vs wrk -> router, same backend")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up seconds per proxy")
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    parser.add_argument(
        "--nginx-keepalive",
        type=int,
        default=64,
        help="nginx's idle upstream connections (64: more than wrk's 50, so none are re-dialled)",
    )
    parser.add_argument(
        "--space",
        action="store_true",
        help="also measure the reference space's GET /api/version as a second backend",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help=f"taskset: proxy on CPU {PIN_PROXY}, wrk and backend on CPU {PIN_REST}",
    )
    parser.add_argument(
        "--profile", action="store_true", help="then profile the router with py-spy"
    )
    parser.add_argument("--profile-out", help="also write py-spy's collapsed stacks here")
    parser.add_argument(
        "--router-rev",
        metavar="REV",
        help="run this git commit of the router (a git archive of it) instead of the working tree",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = parser.parse_args()
    args.wrk_cpus = PIN_REST if args.pin else None
    proxy_cpus = PIN_PROXY if args.pin else None
    rest_cpus = PIN_REST if args.pin else None

    benchlib.ensure_tools(["nginx", "wrk"])
    benchlib.raise_nofile()
    info = benchlib.machine()
    info["router"] = benchlib.router_label(args.router_rev)
    sections = []
    with benchlib.workspace(args.keep) as (tmp, procs):
        script = tmp / "summary.lua"
        script.write_text(WRK_LUA)
        backends = {HOST: benchlib.start_backend(procs, tmp, rest_cpus)}
        fast = Backend([procs.started[-1][1].pid], backends[HOST])
        if args.space:
            backends["space.localhost"] = benchlib.start_space(procs, tmp, rest_cpus)
            space = Backend([procs.started[-1][1].pid], None)
        nginx_port, nginx = benchlib.start_nginx(
            procs, tmp, backends, proxy_cpus, keepalive=args.nginx_keepalive
        )
        router_port, router = benchlib.start_router(
            procs, tmp, backends, proxy_cpus, args.router_rev
        )
        targets = {
            "nginx": (nginx_port, benchlib.proxy_pids(nginx)),
            "router": (router_port, benchlib.proxy_pids(router)),
        }
        log(f"nginx on :{nginx_port}, router on :{router_port} (pid {router.pid}), temp {tmp}")
        sections.append(
            compare(
                f"bench/backend.py, GET / ({args.connections} connections)",
                "/",
                HOST,
                targets,
                fast,
                args,
                script,
            )
        )
        if args.space:
            sections.append(
                compare(
                    f"reference space, GET /api/version ({args.connections} connections)",
                    "/api/version",
                    "space.localhost",
                    targets,
                    space,
                    args,
                    script,
                )
            )
        if args.profile:
            log("profiling the router with py-spy")
            sections.append(
                "### router profile (bench/backend.py, GET /)\n\n"
                + profile_router(router_port, router.pid, "/", HOST, args, script, tmp)
            )
        procs.check_alive()

    placement = (
        f"taskset: proxy on CPU {PIN_PROXY}; wrk and backend on CPU {PIN_REST}"
        if args.pin
        else "no CPU pinning: wrk, proxy and backend share the CPUs"
    )
    print()
    print("## proxy_vs_nginx")
    print()
    print(benchlib.machine_markdown(info))
    print(
        f"- load: `wrk -t1 -c{args.connections} -d{args.duration:g}s`, {args.rounds} rounds "
        f"alternating, {args.warmup:g}s warm-up each; {placement}"
    )
    print(
        f"- nginx: 1 worker, `keepalive {args.nginx_keepalive}` upstream connections; "
        "upstream dials = connections the backend accepted during the run; other CPU = "
        "CPU used by processes outside the benchmark during the run (should be ~0%)"
    )
    print()
    print("\n".join(sections))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Small-response throughput and latency: wrk -> nginx -> backend against wrk -> router -> backend.

One run, one session, the two proxies measured alternately (A/B, B/A, ...) against the same backend
on the same unix socket, so that drift of the machine hits both alike. Variants:

- plain: HTTP/1.1 keep-alive, bench/backend.py. Goals: req/s >= 0.8x nginx's, p99 <= 1.5x.
- ``--tls``: the same over TLS, connections kept alive (one handshake per connection per run);
  both proxies serve bench.localhost's ``lchat dev-cert`` certificate, chosen by SNI. Goal: CPU
  per request <= 1.5x nginx's.
- ``--space``: the reference space's ``GET /api/version`` as the backend. Goal: req/s >= 0.9x.

``--backend`` chooses what answers behind both proxies in the plain and TLS variants: ``minimal``
(bench/backend.py: status, Content-Type, Content-Length), ``node-like`` (bench/backend.py
``--head node-like``: the head Node's http sends, with Date, ``Connection: keep-alive``,
``Keep-Alive: timeout=5``) or ``nginx`` (an nginx ``return 200`` with the same body: Server, Date,
``Connection: keep-alive``). With a real server's head the goals are issue 33's: CPU/request <=
1.2x nginx's, req/s >= 0.85x, p99 <= 1.5x; over TLS CPU/request <= 1.3x.

Prints every round, the medians, and per variant µs CPU/req, req/s, p50 and p99 of both with the
ratios router/nginx (of the medians, and round by round) and whether each goal is met.

``--workers N`` runs both proxies with N processes (nginx ``worker_processes N``, the router
``LCHAT_WORKERS=N``; default 1, the figures' history). ``--workers-compare`` also runs everything
with one each first, in the same invocation, and prints issue 33's many-core ratios: the router ÷
nginx req/s ratio with N no worse than with 1, the router's CPU per request with N within ±5 % of
its CPU per request with 1, and how the router's connections spread over its workers (its admin
``/status``, when it lists them).

    .venv/bin/python bench/proxy_vs_nginx.py [--rounds 3] [--duration 10] [--connections 50]
        [--tls] [--space] [--no-plain] [--backend minimal|node-like|nginx]
        [--workers N] [--workers-compare]

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
from typing import Any

import benchlib
from benchlib import HOST, log

# wrk's summary as one JSON line: exact percentiles (microseconds) instead of parsing its text.
# wrk sends the URL's host as the TLS SNI name, and bench.localhost does not resolve here (no
# /etc/hosts entry, and it is not ours to edit): every name is looked up as 127.0.0.1 instead, so
# that an https://bench.localhost:PORT/ URL connects to loopback with SNI bench.localhost.
WRK_LUA = """\
wrk.resolve = function(host, service)
  local addrs = wrk.lookup("127.0.0.1", service)
  for i = #addrs, 1, -1 do
    if not wrk.connect(addrs[i]) then table.remove(addrs, i) end
  end
  wrk.addrs = addrs
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50":%.1f,"p90":%.1f,"p99":%.1f,"max":%.1f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True)
class Goal:
    """A bound on router/nginx for one figure (a ratio of the medians of the same run)."""

    key: str  # a key of measure()'s result
    bound: float
    at_least: bool  # the ratio must be >= bound (else <=)

    def text(self) -> str:
        return f"{FIGURES[self.key]} {'≥' if self.at_least else '≤'} {self.bound:g}x nginx's"

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.at_least else ratio <= self.bound


# The figures every variant reports, in this order: name in the tables, how to print one.
FIGURES = {"us_per_req": "µs CPU/req", "rps": "req/s", "p50": "p50", "p99": "p99"}

# Issue 15's goals, against nginx in the same run.
GOALS = {
    "plain": (Goal("rps", 0.8, at_least=True), Goal("p99", 1.5, at_least=False)),
    "tls": (Goal("us_per_req", 1.5, at_least=False),),
    "space": (Goal("rps", 0.9, at_least=True),),
}
# Issue 33's, behind both proxies a backend sending a real server's head (--backend node-like or
# nginx): its hop-by-hop lines must not cost the router more than nginx pays.
GOALS_REAL_HEADS = {
    "plain": (
        Goal("us_per_req", 1.2, at_least=False),
        Goal("rps", 0.85, at_least=True),
        Goal("p99", 1.5, at_least=False),
    ),
    "tls": (Goal("us_per_req", 1.3, at_least=False),),
    "space": GOALS["space"],
}
BUSY = 15.0  # % of a core used by others during a run, above which a verdict gets a warning

# --backend: what answers behind both proxies (plain and TLS variants), as the tables name it.
BACKENDS = {
    "minimal": "bench/backend.py",
    "node-like": "bench/backend.py --head node-like (Node's head)",
    "nginx": "nginx `return 200` (nginx's head)",
}

# CPU placement with --pin on 2 cores: the proxy alone on one, wrk and the backend on the other.
PIN_PROXY, PIN_REST = "1", "0"


@dataclass(frozen=True)
class Target:
    """One proxy as wrk sees it in a variant."""

    port: int
    pids: list[int]  # whose CPU is the proxy's
    tls: bool = False

    def url(self, host: str, path: str) -> str:
        # Over TLS the URL's host is what wrk sends as SNI (the Lua script resolves it locally).
        return (
            f"https://{host}:{self.port}{path}"
            if self.tls
            else f"http://127.0.0.1:{self.port}{path}"
        )


def run_wrk(
    target: Target,
    path: str,
    host: str,
    seconds: float,
    connections: int,
    script: Path,
    cpus: str | None,
) -> dict[str, float]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s"]
    argv += ["-H", f"Host: {host}", "-s", str(script), target.url(host, path)]
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
    target: Target,
    backend: Backend,
    args: argparse.Namespace,
    path: str,
    host: str,
    script: Path,
    seconds: float,
) -> dict[str, float]:
    """One wrk run, plus the CPU the proxy and the backend used and how often the proxy dialled."""
    pids = target.pids
    dials0 = counters(backend)
    proxy0, backend0, own0, busy0, t0 = (
        benchlib.cpu_seconds(pids),
        benchlib.cpu_seconds(backend.pids),
        benchlib.own_cpu_seconds(),
        benchlib.busy_cpu_seconds(),
        time.monotonic(),
    )
    result = run_wrk(target, path, host, seconds, args.connections, script, args.wrk_cpus)
    elapsed = time.monotonic() - t0
    proxy = benchlib.cpu_seconds(pids) - proxy0
    back = benchlib.cpu_seconds(backend.pids) - backend0
    own = benchlib.own_cpu_seconds() - own0  # wrk's and ours
    result["proxy_cpu"] = proxy / elapsed * 100
    # The primary figure: what one request costs the proxy (robust on a shared machine). Per
    # run, so that the median is the median of what each run measured.
    result["us_per_req"] = proxy / result["requests"] * 1e6 if result["requests"] else 0.0
    result["backend_cpu"] = back / elapsed * 100
    # Whatever else ran on the machine meanwhile (other people's tests): it skews the figures.
    busy = benchlib.busy_cpu_seconds() - busy0
    result["other_cpu"] = max(0.0, busy - proxy - back - own) / elapsed * 100
    # New upstream connections during the run: a pool that keeps them all shows ~0.
    result["dials"] = counters(backend) - dials0 if dials0 >= 0 else -1
    log(
        f"{name:6} {result['rps']:9.0f} req/s  p50 {ms(result['p50'])}  p99 {ms(result['p99'])}"
        f"  errors {int(result['errors'])}  proxy CPU {result['proxy_cpu']:.0f}%"
        f"  {result['us_per_req']:.1f} µs/req  other CPU {result['other_cpu']:.0f}%"
    )
    return result


def counters(backend: Backend) -> int:
    if backend.stats_socket is None:
        return -1
    return benchlib.backend_stats(backend.stats_socket)["connections"]


def ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def compare(
    variant: str,
    label: str,
    path: str,
    host: str,
    targets: dict[str, Target],
    backend: Backend,
    args: argparse.Namespace,
    script: Path,
) -> tuple[str, list[str], dict[str, dict[str, float]]]:
    """Warm up, then alternate nginx and router for ``args.rounds`` rounds.

    Returns the variant's markdown section, one verdict line per goal of ``GOALS[variant]``, and
    the medians of each proxy (``{"nginx": {figure: value}, "router": ...}``).
    """
    log(f"{label}: warm-up {args.warmup}s each")
    for name, target in targets.items():
        measure(name, target, backend, args, path, host, script, args.warmup)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    rows = []
    for round_no in range(1, args.rounds + 1):
        order = list(targets) if round_no % 2 else list(reversed(targets))
        for name in order:
            r = measure(name, targets[name], backend, args, path, host, script, args.duration)
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
    n_runs, r_runs = results["nginx"], results["router"]
    n, r = medians["nginx"], medians["router"]
    goals = {g.key: g for g in (GOALS if args.backend == "minimal" else GOALS_REAL_HEADS)[variant]}
    errors = int(sum(x["errors"] for x in n_runs + r_runs))
    other = max(x["other_cpu"] for x in n_runs + r_runs)
    verdicts = []
    ratio_rows = []
    for key, what in FIGURES.items():
        ratio = r[key] / n[key] if n[key] else float("nan")
        per_round = ", ".join(
            f"{b[key] / a[key]:.2f}" if a[key] else "-" for a, b in zip(n_runs, r_runs, strict=True)
        )
        goal = goals.get(key)
        verdict = "-"
        if goal is not None:
            if errors:
                state = f"not judged: {errors} errors"
            else:
                state = "**met**" if goal.met(ratio) else "**NOT met**"
                if other > BUSY:
                    state += f" (others used up to {other:.0f}% of a core meanwhile)"
            verdict = f"{goal.text()}: {state}"
            verdicts.append(
                f"- {VARIANT_NAMES[variant]}: {what} router/nginx **{ratio:.2f}x** "
                f"(goal {'≥' if goal.at_least else '≤'} {goal.bound:g}x): {state}"
            )
        ratio_rows.append(
            [what, fmt(key, n[key]), fmt(key, r[key]), f"{ratio:.2f}x", per_round, verdict]
        )
    text += [
        "Router against nginx in this run (medians of each; per round: the two runs of that round):",
        "",
        benchlib.table(
            ["figure", "nginx", "router", "router/nginx", "per round", "goal"], ratio_rows
        ),
        "",
    ]
    if "compiled" in medians:
        c = medians["compiled"]
        text += [
            f"The compiled-exchange prototype (bench/exchange_cdef.pyx) in this run: "
            f"{c['us_per_req']:.1f} µs CPU/req, {c['us_per_req'] / n['us_per_req']:.2f}x nginx's.",
            "",
        ]
    if "floor" in medians:
        f = medians["floor"]
        text += [
            f"The floor (bench/floor_relay.py: uvloop copying bytes, no HTTP work) in this run: "
            f"{f['us_per_req']:.1f} µs CPU/req, {f['us_per_req'] / n['us_per_req']:.2f}x nginx's; "
            f"the router's work above it: {r['us_per_req'] - f['us_per_req']:.1f} µs/req.",
            "",
        ]
    return "\n".join(text), verdicts, medians


VARIANT_NAMES = {
    "plain": "plain HTTP, keep-alive",
    "tls": "TLS, keep-alive",
    "space": "reference space backend",
}


def fmt(key: str, value: float) -> str:
    if key in ("p50", "p99"):
        return ms(value)
    if key == "us_per_req":
        return f"{value:.1f}"
    return f"{value:.0f}"


def row(round_no: str, name: str, r: dict[str, float]) -> list[str]:
    return [
        round_no,
        name,
        f"{r['rps']:.0f}",
        ms(r["p50"]),
        ms(r["p99"]),
        str(int(r["errors"])),
        f"{r['proxy_cpu']:.0f}%",
        f"{r['us_per_req']:.1f}" if r["requests"] else "-",
        f"{r['backend_cpu']:.0f}%",
        f"{r['dials']:.0f}" if r["dials"] >= 0 else "-",
        f"{r['other_cpu']:.0f}%",
    ]


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def profile_router(
    target: Target,
    pid: int,
    path: str,
    host: str,
    args: argparse.Namespace,
    script: Path,
    tmp: Path,
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
    run_wrk(target, path, host, seconds, args.connections, script, args.wrk_cpus)
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
        "--tls",
        action="store_true",
        help="also measure over TLS on kept-alive connections (both proxies serving the same "
        "lchat dev-cert certificate)",
    )
    parser.add_argument(
        "--space",
        action="store_true",
        help="also measure the reference space's GET /api/version as a second backend",
    )
    parser.add_argument(
        "--no-plain", action="store_true", help="skip the plain HTTP variant (with --tls/--space)"
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
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default="minimal",
        help="what answers behind both proxies (plain and TLS): minimal (bench/backend.py's "
        "head: status, Content-Type, Content-Length; the default), node-like (the head Node's "
        "http sends: Connection: keep-alive, Keep-Alive: timeout=5) or nginx (an nginx "
        "`return 200`: Server, Date, Connection: keep-alive)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes of each proxy: nginx worker_processes N, the router LCHAT_WORKERS=N "
        "(default 1, comparable with the figures' history)",
    )
    parser.add_argument(
        "--workers-compare",
        action="store_true",
        help="also run everything with 1 process each first, in the same invocation, and print "
        "issue 33's many-core ratios (req/s ratio with N >= with 1, the router's CPU/request "
        "within ±5%%, connections spread across the router's workers)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run bench/floor_relay.py (a uvloop relay with no HTTP work at all) in the "
        "plain variant: what uvloop and the kernel cost without the router's own work",
    )
    parser.add_argument(
        "--prototype",
        action="store_true",
        help="also run bench/exchange_cdef.pyx (the one-read exchange as Cython cdef "
        "classes: a prototype, needs `pip install cython`) in the plain variant",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs)")
    args = parser.parse_args()
    if args.no_plain and not (args.tls or args.space):
        parser.error("--no-plain leaves nothing to measure without --tls or --space")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.workers_compare and args.workers < 2:
        parser.error("--workers-compare compares --workers N (N >= 2) with 1: give --workers")
    args.wrk_cpus = PIN_REST if args.pin else None

    benchlib.ensure_tools(["nginx", "wrk"])
    benchlib.raise_nofile()
    info = benchlib.machine()
    info["router"] = benchlib.router_label(args.router_rev)
    counts = [1, args.workers] if args.workers_compare else [args.workers]
    sessions: list[Session] = []
    with benchlib.workspace(args.keep) as (tmp, _procs):
        script = tmp / "summary.lua"
        script.write_text(WRK_LUA)
        for workers in counts:
            # Each count in its own directory with its own processes, stopped before the next.
            where = tmp / f"workers-{workers}" if len(counts) > 1 else tmp
            where.mkdir(exist_ok=True)
            procs = benchlib.Processes(where)
            try:
                sessions.append(run_session(args, where, procs, workers, script, info))
            finally:
                procs.close()

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
    workers_text = " and ".join(str(n) for n in counts)
    print(
        f"- processes: {workers_text} each (nginx `worker_processes`, the router "
        f"`LCHAT_WORKERS`); nginx: `keepalive {args.nginx_keepalive}` upstream connections per "
        "worker; upstream dials = connections the backend accepted during the run; other CPU = "
        "CPU used by processes outside the benchmark during the run (should be ~0%)"
    )
    print(
        "- µs CPU/req = CPU time of the proxy's processes during the run (nginx: master and "
        "workers; the router's process and its workers) ÷ requests completed: the primary figure"
    )
    tls_note = next((x.tls_note for x in sessions if x.tls_note), "")
    if tls_note:
        print(f"- TLS: {tls_note}")
    for x in sessions:
        which = f" ({x.workers} each)" if len(counts) > 1 else ""
        print(f"- router's paths{which}: {x.one_read_note}")
    print()
    if len(sessions) > 1:
        print(f"### Many cores ({args.workers} processes each ÷ 1 each, the same invocation)")
        print()
        print("\n".join(workers_verdicts(sessions[0], sessions[-1])))
        print()
    for x in sessions:
        title = "### Goals (router ÷ nginx, medians of the same run)"
        if len(counts) > 1:
            title += f", {x.workers} process{'es' if x.workers > 1 else ''} each"
        print(title)
        print()
        print("\n".join(x.verdicts))
        print()
    for x in sessions:
        if len(counts) > 1:
            print(f"## {x.workers} process{'es' if x.workers > 1 else ''} each")
            print()
        print("\n".join(x.sections))
    sys.stdout.flush()


@dataclass
class Session:
    """One start of both proxies (``workers`` processes each) and every variant measured."""

    workers: int
    sections: list[str]
    verdicts: list[str]
    medians: dict[str, dict[str, dict[str, float]]]  # variant -> proxy -> figure -> median
    one_read_note: str
    tls_note: str
    spread: list[dict[str, Any]]  # the router's workers as its /status lists them at the end


def run_session(
    args: argparse.Namespace,
    tmp: Path,
    procs: benchlib.Processes,
    workers: int,
    script: Path,
    info: dict[str, str],
) -> Session:
    """Start the backend and both proxies with ``workers`` processes each, measure every
    variant asked for, and stop nothing (the caller closes ``procs``)."""
    proxy_cpus = PIN_PROXY if args.pin else None
    rest_cpus = PIN_REST if args.pin else None
    session = Session(workers, [], [], {}, "", "", [])
    if args.backend == "nginx":
        socket, backend_nginx = benchlib.start_nginx_backend(procs, tmp, rest_cpus)
        backends = {HOST: socket}
        fast = Backend(benchlib.proxy_pids(backend_nginx), None)  # (it counts no dials)
    else:
        head = "node-like" if args.backend == "node-like" else "minimal"
        backends = {HOST: benchlib.start_backend(procs, tmp, rest_cpus, head=head)}
        fast = Backend([procs.started[-1][1].pid], backends[HOST])
    behind = BACKENDS[args.backend]
    if args.space:
        backends["space.localhost"] = benchlib.start_space(procs, tmp, rest_cpus)
        space = Backend([procs.started[-1][1].pid], None)
    certs: Path | None = None  # with --tls: the certificates both proxies serve
    tls_ports: tuple[int, int] | None = None  # with --tls: (nginx's, the router's)
    if args.tls:
        certs = benchlib.dev_certificates(tmp, list(backends), args.router_rev)
        tls_ports = (benchlib.free_port(), benchlib.free_port())
    nginx_port, nginx = benchlib.start_nginx(
        procs,
        tmp,
        backends,
        proxy_cpus,
        keepalive=args.nginx_keepalive,
        tls=(tls_ports[0], certs) if tls_ports is not None and certs is not None else None,
        workers=workers,
    )
    router_port, router = benchlib.start_router(
        procs,
        tmp,
        backends,
        proxy_cpus,
        args.router_rev,
        https_port=tls_ports[1] if tls_ports is not None else None,
        workers=workers,
    )
    info["reactor"] = benchlib.router_reactor(procs, "router", router.pid)
    nginx_pids, router_pids = benchlib.proxy_pids(nginx), benchlib.proxy_pids(router)
    plain = {
        "nginx": Target(nginx_port, nginx_pids),
        "router": Target(router_port, router_pids),
    }
    if args.floor:
        plain["floor"] = start_floor(procs, backends[HOST], proxy_cpus)
    if args.prototype:
        plain["compiled"] = start_floor(procs, backends[HOST], proxy_cpus, "compiled_exchange.py")
    log(
        f"{workers} process{'es' if workers > 1 else ''} each: nginx on :{nginx_port}, router on "
        f":{router_port} (pid {router.pid}), temp {tmp}"
    )

    def variant(
        name: str,
        label: str,
        path: str,
        host: str,
        targets: dict[str, Target],
        backend: Backend,
    ) -> None:
        section, lines, medians = compare(name, label, path, host, targets, backend, args, script)
        session.sections.append(section)
        session.verdicts.extend(lines)
        session.medians[name] = medians

    if not args.no_plain:
        variant(
            "plain",
            f"plain HTTP, {behind}, GET / ({args.connections} connections)",
            "/",
            HOST,
            plain,
            fast,
        )
    if tls_ports is not None and certs is not None:
        secure = {
            "nginx": Target(tls_ports[0], nginx_pids, tls=True),
            "router": Target(tls_ports[1], router_pids, tls=True),
        }
        session.tls_note = tls_description(certs, secure)
        log(f"TLS: nginx on :{tls_ports[0]}, router on :{tls_ports[1]}; {session.tls_note}")
        variant(
            "tls",
            f"TLS on kept-alive connections, {behind}, GET / ({args.connections} connections)",
            "/",
            HOST,
            secure,
            fast,
        )
    if args.space:
        variant(
            "space",
            f"reference space, GET /api/version ({args.connections} connections)",
            "/api/version",
            "space.localhost",
            plain,
            space,
        )
    if args.profile:
        log("profiling the router with py-spy")
        session.sections.append(
            f"### router profile ({behind}, GET /)\n\n"
            + profile_router(plain["router"], router.pid, "/", HOST, args, script, tmp)
        )
    admin_sock = tmp / "router-run" / "router.sock"
    session.one_read_note = one_read_share(admin_sock)
    session.spread = benchlib.router_workers(admin_sock)
    procs.check_alive()
    return session


def start_floor(
    procs: benchlib.Processes, upstream: Path, cpus: str | None, script: str = "floor_relay.py"
) -> Target:
    """bench/floor_relay.py (``--floor``), or the compiled-exchange prototype (``--prototype``),
    in front of the backend's unix socket."""
    port = benchlib.free_port()
    relay = procs.start(
        script.removesuffix(".py"),
        [sys.executable, str(benchlib.BENCH / script), "--port", str(port),
         "--upstream", str(upstream)],
        cpus=cpus,
    )  # fmt: skip
    # (The prototype's first start compiles it: up to a minute.)
    benchlib.wait_until(lambda: benchlib.http_status(port) is not None, 90, script, procs)
    return Target(port, [relay.pid])


WORKERS_CPU_TOLERANCE = 0.05  # the router's CPU/request with N processes within ±5 % of with 1
WORKERS_SPREAD = 0.20  # each worker's share of the connections within ±20 % of an even share


def workers_verdicts(one: Session, many: Session) -> list[str]:
    """Issue 33's many-core lines, per variant measured: the router ÷ nginx req/s ratio with N
    processes each no worse than with 1 each; the router's CPU per request with N within ±5 %
    of with 1; and how its connections spread over its workers."""
    lines = []
    for variant, name in VARIANT_NAMES.items():
        if variant not in one.medians or variant not in many.medians:
            continue
        a, b = one.medians[variant], many.medians[variant]
        rps_1 = a["router"]["rps"] / a["nginx"]["rps"] if a["nginx"]["rps"] else float("nan")
        rps_n = b["router"]["rps"] / b["nginx"]["rps"] if b["nginx"]["rps"] else float("nan")
        state = "**met**" if rps_n >= rps_1 else "**NOT met**"
        lines.append(
            f"- {name}: req/s router/nginx **{rps_n:.2f}x** with {many.workers} each, "
            f"{rps_1:.2f}x with 1 each (goal: no worse): {state}"
        )
        cpu_1, cpu_n = a["router"]["us_per_req"], b["router"]["us_per_req"]
        change = cpu_n / cpu_1 - 1 if cpu_1 else float("nan")
        state = "**met**" if abs(change) <= WORKERS_CPU_TOLERANCE else "**NOT met**"
        lines.append(
            f"- {name}: the router's µs CPU/req {cpu_n:.1f} with {many.workers} workers, "
            f"{cpu_1:.1f} with 1 (**{change:+.1%}**; goal within "
            f"±{WORKERS_CPU_TOLERANCE:.0%}): {state}; nginx's {b['nginx']['us_per_req']:.1f} "
            f"and {a['nginx']['us_per_req']:.1f}"
        )
    lines.append(spread_line(many))
    return lines


def spread_line(session: Session) -> str:
    """The router's connections by worker over the whole session (its ``/status``), and whether
    each worker's share is within ±20 % of an even one. With wrk's 50 kept-alive connections per
    run the kernel's hash has few connections to spread: reported, to be judged on a run with
    many connections."""
    listed = session.spread
    if not listed:
        return (
            f"- connections across workers: not listed (the router's `/status` has no "
            f"`workers`: it runs as one process, LCHAT_WORKERS={session.workers} not in effect)"
        )
    counts = []
    for worker in listed:
        value = worker.get("accepted", worker.get("connections"))
        counts.append(int(value) if isinstance(value, int | float) else 0)
    total = sum(counts)
    if not total:
        return f"- connections across workers: {len(listed)} workers, none counted any"
    even = total / len(counts)
    worst = max(abs(c / even - 1) for c in counts)
    shares = ", ".join(
        f"worker {w.get('slot', k)}: {c} ({c / total:.0%})"
        for k, (w, c) in enumerate(zip(listed, counts, strict=True))
    )
    state = "within" if worst <= WORKERS_SPREAD else "**outside**"
    return (
        f"- connections across workers (accepted over the session): {shares}; the farthest "
        f"from an even share by {worst:.0%}, {state} ±{WORKERS_SPREAD:.0%}"
    )


def one_read_share(admin_socket: Path) -> str:
    """How many of the router's answers over the whole session (warm-ups, profiling included)
    its one-read path relayed, spliced or as they came, from its own metrics: which path the
    figures above measured."""
    try:
        status, body = benchlib.admin(admin_socket, "GET", "/metrics", timeout=10)
    except OSError as e:
        return f"unknown (the router's metrics: {e})"
    if status != 200:
        return f"unknown (the router's metrics: HTTP {status})"
    answered = 0.0
    one_read = {"as_sent": 0.0, "spliced": 0.0}
    for line in body.decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("lchat_http_requests_total{"):
            answered += float(value)
        for head in one_read:
            if name == f'lchat_proxy_one_read_responses_total{{head="{head}"}}':
                one_read[head] = float(value)
    fast = one_read["as_sent"] + one_read["spliced"]
    share = f"{fast / answered:.0%}" if answered else "-"
    return (
        f"{fast:.0f} of {answered:.0f} answers ({share}) relayed whole by the one-read path "
        f"({one_read['spliced']:.0f} of them spliced: hop-by-hop lines taken out), the rest the "
        "general way (`lchat_proxy_one_read_responses_total`)"
    )


def tls_description(certs: Path, targets: dict[str, Target]) -> str:
    """How the TLS variant is set up, and what each proxy negotiated with a verifying client."""
    negotiated = []
    for name, target in targets.items():
        probe = benchlib.tls_probe(target.port, HOST, certs / benchlib.DEV_CA)
        if probe is None:
            raise RuntimeError(f"{name} does not answer over TLS with {HOST}'s certificate")
        status, version, cipher = probe
        negotiated.append(f"{name} {version} {cipher} (HTTP {status})")
    return (
        f"both serve `{certs.name}/{HOST}.pem` from `lchat dev-cert` (ECDSA P-256, verified "
        f"against its dev CA), chosen by SNI; TLS 1.2 and 1.3 offered, no session resumption "
        "(nginx `ssl_session_cache off`, `ssl_session_tickets off`), HTTP/1.1; wrk connects to "
        f"`https://{HOST}:PORT/` (SNI {HOST}, no ALPN) and keeps its connections, so each run "
        "makes one handshake per connection (plus one per error); negotiated: "
        + "; ".join(negotiated)
    )


if __name__ == "__main__":
    main()

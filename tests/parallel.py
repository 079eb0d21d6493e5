"""Run the test modules in parallel, each in a ``trial --reactor=uvloop`` process of its own.

``make unit`` runs this instead of ``trial -j``: trial's distributed runner does not work with an
asyncio reactor (a worker's reactor returns from ``run`` before its test finished, and the worker
dies), and the router runs on one (lchat.uvloop_reactor). Modules are handed out longest first
(their size is the estimate) to ``-j`` slots as they free up, the few load-sensitive ones
(``AT_MOST``) first of all; each gets its own temp directory under one scratch directory in
``$TMPDIR``. Each module's line says its wall time and the CPU time it and its processes used (a
router test mostly waits; a model check such as test_fence_model does not). A passing module's
temp directory is removed as soon as it ends; a failing module's is kept (its ``test.log`` and
whatever its tests left there), and its path is printed with the module's whole output at the
end; the exit status is 1 if any failed. Interrupted (Ctrl-C), it removes the whole scratch
directory.

    python -m tests.parallel [-j N] [module ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRIAL = [sys.executable, "-m", "twisted.trial", "--reactor=uvloop"]
# A module's trial is killed after this long (the longest takes ~2 min): one whose process never
# ends (fc48: every test passed, then it hung in the interpreter's exit) fails by name instead of
# holding the whole run until CI gives up. LCHAT_TEST_MODULE_LIMIT overrides it (seconds).
MODULE_LIMIT = float(os.environ.get("LCHAT_TEST_MODULE_LIMIT", "900"))


# Load-sensitive modules: at most this many modules (the module itself included) run while one of
# these does, whatever ``-j`` says, so what runs beside it stays what it was made reliable under
# (one module, as when ``make unit`` ran -j2). test_mesh_cuts times real routers' heartbeats and leases against each
# other (its cuts land within a heartbeat of a deadline). They are handed out first.
AT_MOST = {"tests.test_mesh_cuts": 2}


def modules() -> list[str]:
    files = sorted(HERE.glob("test_*.py"), key=lambda p: p.stat().st_size, reverse=True)
    names = [f"tests.{p.stem}" for p in files]
    return [n for n in names if n in AT_MOST] + [n for n in names if n not in AT_MOST]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("modules", nargs="*")
    args = parser.parse_args()
    queue = list(args.modules or modules())
    lock = threading.Condition()
    failed: list[tuple[str, str]] = []
    totals = {"tests": 0, "modules": 0, "cpu": 0.0}
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="lchat-trial-")

    jobs = max(1, args.jobs)
    free = [jobs]  # slots not taken by a running module

    def worker(slot: int) -> None:
        while True:
            with lock:
                while True:
                    if not queue:
                        return
                    # (It takes the slots of the modules that may not run beside it.)
                    need = max(1, jobs - AT_MOST.get(queue[0], jobs) + 1)
                    if free[0] >= need:
                        break
                    lock.wait()
                module = queue.pop(0)
                free[0] -= need
            t0 = time.monotonic()
            temp = os.path.join(scratch, module)
            returncode, out, cpu = _trial(module, temp)
            ran = re.search(r"^Ran (\d+) tests?", out, re.MULTILINE)
            verdict = out.strip().splitlines()[-1] if out.strip() else "(no output)"
            if returncode == 0:
                shutil.rmtree(temp, ignore_errors=True)
            with lock:
                totals["modules"] += 1
                totals["tests"] += int(ran.group(1)) if ran else 0
                print(
                    f"[{time.monotonic() - started:6.0f}s] {module}: {verdict}"
                    f" ({time.monotonic() - t0:.1f}s, cpu {cpu:.1f}s)",
                    flush=True,
                )
                totals["cpu"] += cpu
                if returncode != 0:
                    failed.append((module, out))
                free[0] += need
                lock.notify_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(jobs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        # The running trials got the same SIGINT; hand out nothing more and clean up after them.
        with lock:
            queue.clear()
            lock.notify_all()
        for t in threads:
            t.join()
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"\ninterrupted; removed {scratch}", file=sys.stderr, flush=True)
        return 130
    for module, out in failed:
        temp = os.path.join(scratch, module)
        print(
            f"\n{'=' * 30} {module} {'=' * 30}\n{out}\n"
            f"(its temp directory, kept: {temp} ({_size(temp)}); its trial log: {temp}/test.log)",
            flush=True,
        )
    elapsed = time.monotonic() - started
    print(
        f"\n{totals['tests']:.0f} tests in {totals['modules']:.0f} modules, {elapsed:.0f}s"
        f" (cpu {totals['cpu']:.0f}s): "
        + (f"FAILED ({', '.join(m for m, _ in failed)})" if failed else "PASSED"),
        flush=True,
    )
    if failed:
        print(
            f"kept for the failed modules: {scratch} ({_size(scratch)}); `rm -rf {scratch}` when done",
            flush=True,
        )
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


def _trial(module: str, temp: str) -> tuple[int, str, float]:
    """Run one module's trial: its exit code, its output, and the CPU seconds (user + system) it
    and every process it waited for used (its routers, their spaces, the S3 servers it started).
    The CPU time says how much a module waits: a router test mostly does, so more of them than
    there are cores can run side by side."""
    proc = subprocess.Popen(
        [*TRIAL, f"--temp-directory={temp}", module],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert proc.stdout is not None
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    limit = threading.Timer(MODULE_LIMIT, kill)
    limit.daemon = True
    limit.start()
    try:
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        limit.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait)
    if killed.is_set():
        out += (
            f"\n{module}: killed after {MODULE_LIMIT:.0f}s (LCHAT_TEST_MODULE_LIMIT): its trial "
            f"did not end (a test that hangs, or a process kept alive at exit by a thread)\n"
        )
    return proc.returncode, out, usage.ru_utime + usage.ru_stime


def _size(path: str) -> str:
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return f"{total / 1e6:.0f} MB" if total >= 1e6 else f"{total / 1e3:.0f} kB"


if __name__ == "__main__":
    sys.exit(main())

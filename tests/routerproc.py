"""A real ``twistd lchat`` router as a child process, for the tests that need one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn_router(
    env_file: str, log_path: str, argv_prefix: Sequence[str] = (), workers: int = 1
) -> subprocess.Popen[bytes]:
    """Start ``twistd --nodaemon lchat --env-file ENV_FILE`` with its output appended to
    ``log_path``. Only the env file configures it: the test's own ``LCHAT_*`` are not passed on.
    ``argv_prefix``: a command that execs the router in place (``setpriv ... --``: another user).
    ``workers``: LCHAT_WORKERS, in its environment (over the env file's): one process unless a
    test asks for worker processes (the default ``auto`` would run one a core)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    env["LCHAT_WORKERS"] = str(workers)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [
                *argv_prefix,
                sys.executable,
                "-c",
                "from twisted.scripts.twistd import run; run()",
                "--nodaemon",
                "--pidfile=",
                "lchat",
                "--env-file",
                env_file,
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def kill_spaces_under(root: str) -> list[int]:
    """SIGKILL every process whose environment puts its socket or database under ``root``: the
    spaces a router that a test SIGKILLed left running. They run in sessions of their own, as in
    production, where systemd's cgroup (KillMode=mixed) ends them with the router; a test has no
    cgroup to do it. Returns the pids signalled."""
    root = os.path.realpath(root) + os.sep
    killed = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        for entry in environ:
            key, _, value = entry.partition(b"=")
            if key in (b"LCHAT_SOCKET", b"LCHAT_DB"):
                path = os.path.realpath(os.fsdecode(value))
                if path.startswith(root):
                    try:
                        os.kill(int(name), signal.SIGKILL)
                        killed.append(int(name))
                    except ProcessLookupError:
                        pass
                    break
    return killed

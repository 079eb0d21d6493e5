"""A real ``twistd lchat`` router as a child process, for the tests that need one."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn_router(env_file: str, log_path: str) -> subprocess.Popen[bytes]:
    """Start ``twistd --nodaemon lchat --env-file ENV_FILE`` with its output appended to
    ``log_path``. Only the env file configures it: the test's own ``LCHAT_*`` are not passed on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LCHAT_")}
    env["PYTHONPATH"] = ROOT
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [
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

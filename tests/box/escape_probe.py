#!/opt/lchat/venv/bin/python3
"""A space build that first tries every escape a compromised space might (issue 30, item 3),
prints the outcomes as one ``ESCAPE {json}`` line on stderr (the journal), then runs the reference
space. Copied into the box by tests/box/test_box_systemd.py; its targets come from
``/etc/lchat-escape/<host>.json`` (the other space, its pid, the data and run dirs)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

HOST = os.environ["LCHAT_HOST"]
with open(f"/etc/lchat-escape/{HOST}.json") as f:
    TARGETS = json.load(f)
OTHER, OTHER_PID = TARGETS["other"], int(TARGETS["other_pid"])
DATA, RUN = TARGETS.get("data", "/data"), TARGETS.get("run", "/run/lchat")
outcomes: dict[str, object] = {}


def attempt(name: str, action: Callable[[], object]) -> None:
    try:
        action()
    except OSError as e:
        outcomes[name] = f"refused: {type(e).__name__}: {e.strerror}"
    else:
        outcomes[name] = "ALLOWED"


def read(path: str) -> Callable[[], object]:
    def go() -> object:
        with open(path, "rb") as f:
            return f.read(64)

    return go


def connect(path: str) -> Callable[[], object]:
    def go() -> object:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(path)
        return None

    return go


def create(path: str) -> Callable[[], object]:
    def go() -> object:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(path)
        return None

    return go


assert OTHER_PID > 1, OTHER_PID  # kill(0) or kill(1) would prove nothing
other_db = TARGETS["other_db"]
attempt("read router.env", read(f"{DATA}/router.env"))
attempt("read the other space's env file", read(f"{DATA}/{OTHER}.env"))
attempt("read the other space's database", read(other_db))
attempt("list the other space's directory", lambda: os.listdir(os.path.dirname(other_db)))
attempt("read the registry", read(f"{DATA}/registry.db"))
attempt("list the ACME cache", lambda: os.listdir(f"{DATA}/acme"))
try:  # a unit sees an empty tmpfs with its own directory bound in: nothing of the box's
    outcomes["list the data dir"] = sorted(os.listdir(DATA))
except OSError as e:
    outcomes["list the data dir"] = f"refused: {type(e).__name__}: {e.strerror}"
attempt("connect to the other space's socket", connect(TARGETS["other_socket"]))
attempt("connect to the admin socket", connect(f"{RUN}/router.sock"))
attempt("plant a file in the data dir", create(f"{DATA}/planted"))
attempt("plant a socket in the run dir", create(f"{RUN}/planted.sock"))
attempt("signal the other space", lambda: os.kill(OTHER_PID, 0))
attempt("SIGTERM the other space", lambda: os.kill(OTHER_PID, signal.SIGTERM))
attempt("SIGTERM the router", lambda: os.kill(int(TARGETS["router_pid"]), signal.SIGTERM))
attempt(
    "write in its own directory",
    create(os.path.join(os.path.dirname(os.environ["LCHAT_DB"]), "own")),
)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
outcomes["ids"] = {
    k: status[k].split()
    for k in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapAmb", "NoNewPrivs")
}
credentials = os.environ.get("CREDENTIALS_DIRECTORY")
if credentials:
    attempt("read its own credential", read(os.path.join(credentials, "env")))
child = subprocess.run(["/usr/bin/env"], capture_output=True, text=True).stdout
outcomes["admin token in a child's environment"] = "LCHAT_ADMIN_TOKEN" in child
outcomes["admin token in its own environment"] = "LCHAT_ADMIN_TOKEN" in os.environ
print("ESCAPE " + json.dumps(outcomes, sort_keys=True), file=sys.stderr, flush=True)
os.execv(sys.executable, [sys.executable, "-m", "lchat.space"])  # noqa: S606 -- the space itself

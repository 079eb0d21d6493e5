#!/usr/bin/env python3
"""A space that tries every escape a compromised space might (issue 30, item 3), for
tests/test_isolation.py: run by a real router (builtin units or the activator) as the space's own
user, it records what it is and what it was refused, then serves like a space.

At start, in its own directory (the directory of ``LCHAT_DB``; ``<data>/spaces/<host>``):

* ``pid``: its pid (the test hands it to the other space);
* ``own.json``: who it runs as (``/proc/self/status``) and the attempts that need no target:
  the router's files, the admin socket, planting files, the router's process.

Then it waits (in a thread, up to a minute) for ``targets.json`` in that directory, written there by
the test: another space's host, pid, database and socket, and every path under the data and run
directories the test saw (as root). It tries each, and writes ``escapes.json``. Each outcome is
``"refused: <exception>: <why>"`` or ``"ALLOWED"``; both files are also logged on stderr (the router's
log). Data and run directories are derived from ``LCHAT_DB`` and ``LCHAT_SOCKET``.

It serves HTTP on ``LCHAT_SOCKET`` meanwhile (``/api/version``, ``/api/next-due``) over a WAL
database at ``LCHAT_DB``: the contract the router's readiness probe and the activator need.
Standard library only: it runs under any Python the space's user can execute.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import socketserver
import sqlite3
import sys
import threading
import time
from collections.abc import Callable

DB = os.environ["LCHAT_DB"]
SOCKET = os.environ["LCHAT_SOCKET"]
HOST = os.environ["LCHAT_HOST"]
OWN = os.path.dirname(DB)  # <data>/spaces/<host>
DATA = os.path.dirname(os.path.dirname(OWN))
RUN = os.path.dirname(os.path.dirname(os.path.dirname(SOCKET)))  # <run>/spaces/<host>/<host>.sock


def attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as e:
        return f"refused: {type(e).__name__}: {e.strerror}"
    return "ALLOWED"


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
        os.unlink(path)  # ALLOWED says it all; a restarted probe tries again
        return None

    return go


def link(source: str, name: str) -> Callable[[], object]:
    def go() -> object:
        os.link(source, name)
        os.unlink(name)
        return None

    return go


def status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def write_json(name: str, outcomes: dict[str, object]) -> None:
    path = os.path.join(OWN, name)
    with open(path + ".tmp", "w") as f:
        json.dump(outcomes, f, sort_keys=True)
    os.replace(path + ".tmp", path)  # the test never reads half a file
    print(f"isolation probe {HOST} {name}: {json.dumps(outcomes, sort_keys=True)}", file=sys.stderr)
    sys.stderr.flush()


def own() -> dict[str, object]:
    """Who this process is, what it may do in its own directory, and the escapes that need no
    target (the router and the box, not another space)."""
    me = status()
    router = os.getppid()  # setsid and setpriv exec in place: the parent is the router
    outcomes: dict[str, object] = {
        "status": {
            k: me[k]
            for k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")
        },
        "router_pid": router,
        "own: create a file in its own directory": attempt(create(os.path.join(OWN, "own-file"))),
        "read <data>/router.env": attempt(read(os.path.join(DATA, "router.env"))),
        "read <data>/registry.db": attempt(read(os.path.join(DATA, "registry.db"))),
        "list <data>/acme": attempt(lambda: os.listdir(os.path.join(DATA, "acme"))),
        "read <data>/acme/account.key": attempt(read(os.path.join(DATA, "acme", "account.key"))),
        "list <data>": attempt(lambda: os.listdir(DATA)),
        "list <data>/spaces": attempt(lambda: os.listdir(os.path.join(DATA, "spaces"))),
        "list <run>": attempt(lambda: os.listdir(RUN)),
        "connect to the admin socket <run>/router.sock": attempt(
            connect(os.path.join(RUN, "router.sock"))
        ),
        "plant a file in <data>": attempt(create(os.path.join(DATA, f"planted-by-{HOST}"))),
        "plant a file in <data>/spaces": attempt(
            create(os.path.join(DATA, "spaces", f"planted-by-{HOST}"))
        ),
        "plant a file in <run>": attempt(create(os.path.join(RUN, f"planted-by-{HOST}"))),
        "plant a file in <run>/spaces": attempt(
            create(os.path.join(RUN, "spaces", f"planted-by-{HOST}"))
        ),
        # A link in its own directory is a name the router opens as root (its database):
        # fs.protected_hardlinks refuses linking a file one can neither read nor write.
        "hard-link <data>/registry.db into its own directory": attempt(
            link(os.path.join(DATA, "registry.db"), os.path.join(OWN, "linked-registry"))
        ),
        "read the router's /proc/<pid>/environ": attempt(read(f"/proc/{router}/environ")),
        "signal 0 to the router": attempt(lambda: os.kill(router, 0)),
    }
    return outcomes


def escapes(targets: dict[str, object]) -> dict[str, object]:
    """The attempts on another space (and on every path the test saw under data and run)."""
    other = str(targets["host"])
    pid = int(str(targets["pid"]))
    assert pid > 1, pid  # kill(0) or kill(1) would prove nothing
    other_dir = os.path.join(DATA, "spaces", other)
    outcomes: dict[str, object] = {
        "read the other space's env file <data>/<B>.env": attempt(
            read(os.path.join(DATA, f"{other}.env"))
        ),
        "read the other space's database": attempt(read(str(targets["db"]))),
        "list the other space's directory <data>/spaces/<B>": attempt(
            lambda: os.listdir(other_dir)
        ),
        "create a file in the other space's directory": attempt(
            create(os.path.join(other_dir, f"planted-by-{HOST}"))
        ),
        "connect to the other space's socket": attempt(connect(str(targets["socket"]))),
        "read the other space's /proc/<pid>/environ": attempt(read(f"/proc/{pid}/environ")),
        "signal 0 to the other space": attempt(lambda: os.kill(pid, 0)),
        "SIGTERM to the other space": attempt(lambda: os.kill(pid, signal.SIGTERM)),
    }
    paths = targets.get("paths", [])
    assert isinstance(paths, list)
    for path in paths:
        opener = connect(path) if path.endswith(".sock") else read(path)
        outcomes[f"open {path}"] = attempt(opener)
    return outcomes


def await_targets() -> None:
    path = os.path.join(OWN, "targets.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    with open(path) as f:
        targets = json.load(f)
    write_json("escapes.json", escapes(targets))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        answer: dict[str, object]
        if self.path.startswith("/api/next-due"):
            answer = {"due": 0}
        else:
            answer = {"version": "isolation-probe", "build": "test", "uid": os.getuid()}
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def main() -> None:
    link = os.environ.get("PROBE_DB_LINK")
    if link and not os.path.lexists(DB):
        # A hostile space's database: a link to a file it cannot read, for the router to open.
        os.symlink(link, DB)
    if not link:
        conn = sqlite3.connect(DB)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS t(x)")
        conn.close()
    with open(os.path.join(OWN, "pid"), "w") as f:
        f.write(str(os.getpid()))
    write_json("own.json", own())
    threading.Thread(target=await_targets, daemon=True).start()
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)
    with _Server(SOCKET, _Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()

"""A space for tests that takes its time and does not drain: ``GET /slow`` answers after
``LCHAT_SLOW`` seconds (default 1), and SIGTERM kills it at once, mid-request (the default
action: no handler). It honours the rest of the contract the activator needs: ``LCHAT_SOCKET``,
a WAL database at ``LCHAT_DB``, ``/api/version`` and ``/api/next-due``.

Run as ``python tests/slow_space.py`` (standard library only)."""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import sqlite3
import time


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        answer: dict[str, object]
        if self.path.startswith("/slow"):
            time.sleep(float(os.environ.get("LCHAT_SLOW", "1")))
            answer = {"slow": True}
        elif self.path.startswith("/api/next-due"):
            answer = {"due": 0}
        else:
            answer = {"version": "slow", "build": "test"}
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
    conn = sqlite3.connect(os.environ["LCHAT_DB"])
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t(x)")
    conn.close()
    path = os.environ["LCHAT_SOCKET"]
    if os.path.exists(path):
        os.unlink(path)
    with _Server(path, _Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()

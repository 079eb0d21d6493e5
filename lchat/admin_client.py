"""Blocking HTTP/1.1 over a unix socket: the CLI's (and ``lchat.release.deploy``'s)
road to the router's admin API and to spaces.

``http.client`` does the HTTP; only ``connect()`` changes, to dial ``AF_UNIX``. Connection failures
(no socket file, nobody listening, no permission) surface as :class:`Unreachable` so callers can tell
"the router is not running" apart from "the router answered badly".
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any, Protocol

from attrs import frozen

DEFAULT_TIMEOUT = 5.0


class Unreachable(Exception):
    """Nothing accepted a connection on the socket."""


class ProtocolError(Exception):
    """Something accepted the connection but did not answer HTTP in time."""


@frozen
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose transport is a unix stream socket."""

    def __init__(self, socket_path: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        # The host only fills the Host header; callers may override it per request.
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except (OSError, ValueError) as e:
            sock.close()
            raise Unreachable(f"{self.socket_path}: {_reason(e)}") from e
        self.sock = sock


def request(
    socket_path: str,
    method: str,
    path: str,
    *,
    host: str = "localhost",
    body: bytes | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    read_body: bool = True,
) -> Response:
    """One request on a fresh connection. Raises :class:`Unreachable` or :class:`ProtocolError`."""
    conn = UnixHTTPConnection(socket_path, timeout=timeout)
    headers = {"Host": host, "Connection": "close"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read() if read_body else b""
        return Response(status=response.status, body=data)
    except Unreachable:
        raise
    except (OSError, http.client.HTTPException) as e:
        raise ProtocolError(f"{socket_path}: {_reason(e)}") from e
    finally:
        conn.close()


def status(admin_socket: str, timeout: float = DEFAULT_TIMEOUT) -> Response:
    """The running router's ``GET /status`` (per-host row, process and activator state)."""
    return request(admin_socket, "GET", "/status", timeout=timeout)


def sleep_space(
    admin_socket: str, host: str, timeout: float, hold: float | None = None
) -> Response:
    """``POST /sleep?host=H``: answers once the space is asleep (flushed, lease released).
    ``hold``: and no wake of it on this box for that many seconds, or until ``POST /release``."""
    extra = {} if hold is None else {"hold": f"{hold:g}"}
    path = _with_host("/sleep", host, **extra)
    return request(admin_socket, "POST", path, body=b"{}", timeout=timeout)


def _with_host(path: str, host: str, **extra: str) -> str:
    return f"{path}?{urllib.parse.urlencode({'host': host, **extra})}"


class RouterAdmin(Protocol):
    """The router's admin API, one call each (:class:`SocketAdmin`; tests: an in-memory one)."""

    def status(self, timeout: float) -> Response: ...
    def reload(self) -> Response: ...
    def wake(self, host: str, timeout: float) -> Response: ...
    def sleep(self, host: str, timeout: float) -> Response: ...
    # lchat relocate's hold on a space's wakes on this box while it moves (POST /sleep?hold=S)
    def sleep_held(self, host: str, hold: float, timeout: float) -> Response: ...
    def release(self, host: str) -> Response: ...
    def restart(self, host: str, timeout: float) -> Response: ...


@frozen
class SocketAdmin:
    """:class:`RouterAdmin` over the router's admin socket."""

    path: str

    def status(self, timeout: float) -> Response:
        return status(self.path, timeout=timeout)

    def reload(self) -> Response:
        """Re-read the registry now."""
        return request(self.path, "POST", "/reload", body=b"{}")

    def wake(self, host: str, timeout: float) -> Response:
        """Answers once the hibernating space is awake (200), or 503 with why not, or 409 when
        the router has no activator."""
        return self._post("/wake", host, timeout)

    def sleep(self, host: str, timeout: float) -> Response:
        return sleep_space(self.path, host, timeout)

    def sleep_held(self, host: str, hold: float, timeout: float) -> Response:
        return sleep_space(self.path, host, timeout, hold=hold)

    def release(self, host: str) -> Response:
        """End a hold :meth:`sleep_held` put on the space."""
        return self._post("/release", host, DEFAULT_TIMEOUT)

    def restart(self, host: str, timeout: float) -> Response:
        return self._post("/restart", host, timeout)

    def _post(self, path: str, host: str, timeout: float) -> Response:
        return request(self.path, "POST", _with_host(path, host), body=b"{}", timeout=timeout)


def has_listener(socket_path: str, timeout: float = 2.0) -> bool:
    """True when something accepts connections on ``socket_path`` (no bytes are sent)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(socket_path)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except (TimeoutError, BlockingIOError):
        return True  # a full backlog: someone is listening, just not accepting fast enough
    finally:
        sock.close()
    return True


def answers_http(socket_path: str, host: str, timeout: float = DEFAULT_TIMEOUT) -> str | None:
    """None if ``GET /`` gets any status line within ``timeout``; else why not, in a few words."""
    try:
        request(socket_path, "GET", "/", host=host, timeout=timeout, read_body=False)
    except (Unreachable, ProtocolError) as e:
        return str(e)
    return None


def wait_for_version(socket_path: str, host: str, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``GET /api/version`` until it answers 200 (True) or ``timeout`` runs out (False)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            got = request(
                socket_path, "GET", "/api/version", host=host, timeout=min(2.0, remaining)
            )
        except (Unreachable, ProtocolError):
            pass
        else:
            if got.status == 200:
                return True
        # The CLI is synchronous: no reactor here to block.
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def _reason(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return "no such socket"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e) or type(e).__name__

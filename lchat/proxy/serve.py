"""The front door's listening sockets: bound before privileges drop, served on the uvloop loop.

A :class:`FrontListener` is a Twisted service (the control plane starts and stops it) around a
:class:`FrontPort`, which serves a :class:`~lchat.proxy.downstream.ProxyFactory` on one socket on
the reactor's own asyncio loop: plain HTTP through uvloop's C accept loop (``create_server``), TLS
through :class:`~lchat.proxy.tls_accept.TLSAcceptor` (which may hold a new host's first handshake
while its certificate is issued).

Invariants:

- the socket is bound and listening from ``privilegedStartService`` on (ports 80 and 443 for an
  unprivileged user; a failure to bind fails the boot, naming the address); connections arriving
  before the loop runs wait in the kernel's queue;
- the listen backlog is the system's ``net.core.somaxconn`` (not Python's 100 or Twisted's 50):
  a burst of connections is queued by the kernel, not refused;
- at stop, the connections the kernel already completed are accepted and served (answered, or
  refused as a draining router does) before the socket closes: closing a listening socket would
  reset them unanswered (lchat.listener explains why that matters to a mesh peer).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from typing import Any

from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from lchat import tls
from lchat.proxy.tls_accept import TLSAcceptor

_log = Logger(namespace="lchat.proxy")

SOMAXCONN_FILE = "/proc/sys/net/core/somaxconn"


class ListenError(Exception):
    """An address the front door cannot listen on (the message names it and why)."""


def somaxconn() -> int:
    """The kernel's cap on a listen backlog (what nginx uses too, up to its own default)."""
    try:
        with open(SOMAXCONN_FILE) as f:
            return max(int(f.read().strip()), 128)
    except (OSError, ValueError):
        return socket.SOMAXCONN


def _split(text: str) -> list[str]:
    """A Twisted endpoint string's fields: split on ``:``, keeping ``\\:`` as a colon."""
    fields, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ":":
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
    fields.append("".join(current))
    return fields


def parse_address(address: str) -> tuple[socket.AddressFamily, Any]:
    """``tcp:PORT[:interface=IP]``, ``tcp6:PORT[:interface=IP6]`` or ``unix:PATH`` (the forms
    lchat.config.parse_address produces) -> (family, bind address)."""
    kind, *rest = _split(address)
    positional = [f for f in rest if "=" not in f]
    options = dict(f.split("=", 1) for f in rest if "=" in f)
    if kind in ("tcp", "tcp6") and positional:
        try:
            port = int(positional[0])
        except ValueError:
            raise ListenError(f"{address}: {positional[0]!r} is not a port") from None
        if kind == "tcp":
            return socket.AF_INET, (options.get("interface", "0.0.0.0"), port)  # noqa: S104
        return socket.AF_INET6, (options.get("interface", "::"), port)
    if kind == "unix" and positional:
        return socket.AF_UNIX, positional[0]
    raise ListenError(
        f"{address}: the front door listens on tcp:PORT, tcp6:PORT or unix:PATH addresses"
        " (HOST:PORT in LCHAT_HTTP_ADDR/LCHAT_HTTPS_ADDR)"
    )


def bind(address: str, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking socket bound to ``address`` and listening with the system's backlog.
    ``reuse_port``: several processes may bind the same port (SO_REUSEPORT; the kernel spreads
    new connections over them)."""
    family, where = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        elif os.path.exists(where):
            os.unlink(where)  # a stale socket of a previous run (we own the run dir)
        sock.bind(where)
        sock.listen(somaxconn())
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {address}: {e.strerror or e}") from e
    return sock


class FrontPort:
    """``factory`` served on the bound, listening ``sock``; TLS when ``store`` is given.

    ``getHost()`` and ``stopListening()`` as a Twisted listening port has them (diagnostics and
    tests treat both alike)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Any,
        store: tls.CertStore | None = None,
        *,
        first_contact_wait: float = 10.0,
        handshake_timeout: float = 10.0,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self.factory = factory
        self.secure = store is not None
        self._host = sock_address(sock)
        self._server: asyncio.AbstractServer | None = None
        self._backlog_sock: socket.socket | None = None  # plain: a dup to drain the queue at stop
        self._tls: TLSAcceptor | None = None
        self._closed = False
        self._handing_over: set[asyncio.Future[Any]] = set()  # queued connections at stop
        if store is not None:
            self._tls = TLSAcceptor(
                loop,
                sock,
                factory,
                store,
                clock=factory.reactor,  # (ProxyFactory's: the front door's one clock)
                hold=first_contact_wait,
                handshake_timeout=handshake_timeout,
                peek_timeout=handshake_timeout,
            )

    def start(self) -> Deferred[None]:
        """Serve from now on (or from when the loop runs, if it does not yet)."""
        if self._tls is not None:
            self._tls.start()
            return succeed(None)
        self._backlog_sock = self._sock.dup()
        self._backlog_sock.setblocking(False)
        future = asyncio.ensure_future(self._serve_plain(), loop=self._loop)
        return Deferred.fromFuture(future)

    async def _serve_plain(self) -> None:
        if self._closed:
            self._sock.close()  # stopped before the loop got here
            return
        try:
            self._server = await self._loop.create_server(
                self.factory, sock=self._sock, backlog=somaxconn()
            )
        except BaseException:
            self._sock.close()
            raise
        if self._closed:
            self._server.close()  # stopped while it was being set up

    @property
    def handshaking(self) -> int:
        """TLS handshakes in progress (accepted, not yet a connection of the factory's)."""
        return self._tls.pending if self._tls is not None else 0

    def getHost(self) -> Any:  # IPv4Address, IPv6Address or UNIXAddress
        return self._host

    def stopListening(self) -> Deferred[None]:
        """Accept what the kernel queued, then close the socket (connections live on)."""
        if self._closed:
            return succeed(None)
        self._closed = True
        if self._tls is not None:
            self._tls.accept_backlog()
            self._tls.close()
            return succeed(None)
        if self._server is not None:
            self._server.close()
        spare, self._backlog_sock = self._backlog_sock, None
        if spare is not None:
            self._accept_queued(spare)
            spare.close()
        return succeed(None)

    def _accept_queued(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    _log.warn("accepting the last queued connections failed: {e}", e=e)
                    return
                continue
            conn.setblocking(False)
            task = asyncio.ensure_future(
                self._loop.connect_accepted_socket(self.factory, conn), loop=self._loop
            )
            self._handing_over.add(task)
            task.add_done_callback(self._handing_over.discard)


def sock_address(sock: socket.socket) -> IPv4Address | IPv6Address | UNIXAddress:
    name = sock.getsockname()
    if sock.family == socket.AF_INET:
        return IPv4Address("TCP", name[0], name[1])
    if sock.family == socket.AF_INET6:
        return IPv6Address("TCP", name[0], name[1])
    return UNIXAddress(name)


class FrontListener(Service):
    """A :class:`FrontPort` as a service: bound at privileged start (a failure fails the boot),
    serving at start, drained (queued connections accepted) and closed at stop.

    ``sock``: an already bound and listening socket to serve instead of binding ``address`` (a
    worker process's slot socket, inherited from the control process: lchat.worker_tap);
    ``address`` then only names it in logs. The listener owns it: it is closed at stop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        address: str,
        factory: Any,
        store: tls.CertStore | None = None,
        *,
        reuse_port: bool = False,
        sock: socket.socket | None = None,
        **timeouts: float,  # FrontPort's first_contact_wait and handshake_timeout
    ) -> None:
        self._loop = loop
        self._sock = sock
        self.address = address
        self.factory = factory
        self._store = store
        self._timeouts = timeouts
        self._reuse_port = reuse_port
        self.port: FrontPort | None = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._bind()

    def startService(self) -> None:
        super().startService()
        self._bind()
        assert self.port is not None
        self.port.start().addErrback(
            lambda f: _log.failure("serving {address} failed", f, address=self.address)
        )

    def _bind(self) -> None:
        if self.port is not None:
            return
        sock, self._sock = self._sock, None
        if sock is None:
            sock = bind(self.address, reuse_port=self._reuse_port)
        else:
            sock.setblocking(False)
        self.port = FrontPort(self._loop, sock, self.factory, self._store, **self._timeouts)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        port, self.port = self.port, None
        return port.stopListening() if port is not None else None

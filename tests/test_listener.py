"""lchat.listener.Listener: binds at privileged start, fails the boot when it cannot, and at stop
answers the connections the kernel completed but nobody accepted yet (closing a listening socket
resets them: a client that connected and sent a request a moment before would get no answer)."""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from lchat.listener import Listener

reactor: Any = _reactor


class _Greeter(Protocol):
    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"hello\n")
        self.transport.loseConnection()


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks: list[bytes] = []
    while True:
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            return b"".join(chunks) + b"<reset>"
        if not data:
            return b"".join(chunks)
        chunks.append(data)


class ListenerTests(TestCase):
    def listener(self) -> Listener:
        listener = Listener(
            serverFromString(reactor, "tcp:0:interface=127.0.0.1"), Factory.forProtocol(_Greeter)
        )
        listener.privilegedStartService()
        listener.startService()
        self.addCleanup(lambda: listener.stopService() if listener.running else None)
        return listener

    async def test_serves_while_running(self) -> None:
        listener = self.listener()
        assert listener.port is not None
        port = listener.port.getHost().port  # type: ignore[attr-defined]
        sock = socket.create_connection(("127.0.0.1", port))
        self.addCleanup(sock.close)
        self.assertEqual(await deferToThread(_read_all, sock), b"hello\n")

    def test_a_port_in_use_fails_the_boot(self) -> None:
        taken = socket.socket()
        self.addCleanup(taken.close)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listener = Listener(
            serverFromString(reactor, f"tcp:{port}:interface=127.0.0.1"),
            Factory.forProtocol(_Greeter),
        )
        with self.assertRaises(Exception) as caught:
            listener.privilegedStartService()
        self.assertIn("Address already in use", str(caught.exception))
        self.assertIsNone(listener.port)

    async def test_connections_queued_at_stop_are_answered_not_reset(self) -> None:
        listener = self.listener()
        assert listener.port is not None
        port = listener.port.getHost().port  # type: ignore[attr-defined]
        # Connected in the kernel, never accepted by the reactor (it has not run since).
        queued = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        for sock in queued:
            self.addCleanup(sock.close)
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        stopped = listener.stopService()
        assert stopped is not None
        await stopped
        await deferLater(reactor, 0.05, lambda: None)
        for sock in queued:
            self.assertEqual(await deferToThread(_read_all, sock), b"hello\n")
        refused = socket.socket()
        self.addCleanup(refused.close)
        self.assertNotEqual(refused.connect_ex(("127.0.0.1", port)), 0, "no longer listening")

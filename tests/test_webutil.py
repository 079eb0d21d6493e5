"""lchat.webutil.answerable, on real loopback HTTP connections."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from twisted.internet.endpoints import serverFromString
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from lchat.reactors import installed
from lchat.webutil import answerable

reactor = installed()


class _Held(Resource):
    """Answers nothing by itself: the test answers (or not) later."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[Request, Callable[[], bool]]] = []

    def render_GET(self, request: Request) -> int:
        self.held.append((request, answerable(request)))
        return NOT_DONE_YET


async def until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await deferLater(reactor, 0.01, lambda: None)


class AnswerableTests(TestCase):
    async def serve(self) -> tuple[_Held, int]:
        resource = _Held()
        port = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(Site(resource))
        self.addCleanup(port.stopListening)
        return resource, port.getHost().port

    def client(self, port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.addCleanup(sock.close)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock

    async def test_answerable_until_finished(self) -> None:
        resource, port = await self.serve()
        self.client(port)
        await until(lambda: bool(resource.held), 5, "the request")
        request, still = resource.held[0]
        self.assertTrue(still())
        request.write(b"done")
        request.finish()
        self.assertFalse(still())

    async def test_not_answerable_once_the_client_has_gone(self) -> None:
        resource, port = await self.serve()
        self.client(port).close()
        await until(lambda: bool(resource.held), 5, "the request")
        _, still = resource.held[0]
        await until(lambda: not still(), 5, "the lost connection being noticed")

"""Small twisted.web pieces shared by the router's HTTP listeners."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer
from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http import Request
from twisted.web.iweb import IBodyProducer
from twisted.web.server import Site
from zope.interface import implementer


class QuietSite(Site):
    """A Site that writes no per-request access log (the router's own metrics and logs say more)."""

    noisy = False
    displayTracebacks = False

    def log(self, request: Request) -> None:
        pass


class _QuietClientFactory(_HTTP11ClientFactory):
    noisy = False  # one per connection: "Starting factory" lines would drown the log


def quiet_pool(reactor: Any, persistent: bool) -> HTTPConnectionPool:
    """An HTTP client connection pool whose per-connection factories do not log."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    pool._factory = _QuietClientFactory
    return pool


@implementer(IBodyProducer)
class BytesProducer:
    """A request body that is already in memory, written at once (no cooperator: it works on any
    reactor, including a CLI's own)."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass

"""Small twisted.web pieces shared by the router's HTTP listeners."""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer
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


def answerable(request: Request) -> Callable[[], bool]:
    """Call before answering ``request`` asynchronously: the function returned says whether it can
    still be answered (neither finished nor abandoned by its client, whose ``finish()`` would raise).

    Learnt from the public ``Request.notifyFinish()``, whose Deferred fails when the connection is
    lost before the request finishes (not from the private ``Request._disconnected``).
    """
    lost: list[bool] = []
    request.notifyFinish().addErrback(lambda _: lost.append(True))
    return lambda: not lost and not request.finished


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

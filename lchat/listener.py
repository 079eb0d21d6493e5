"""A listening endpoint as a service, for every socket the router serves.

Like Twisted's ``StreamServerEndpointService``, it binds in ``privilegedStartService`` (before
twistd drops privileges, so ports 80 and 443 work for an unprivileged user), and unlike it:

- a failure to listen fails the boot, with the endpoint's own error (no private switch needed);
- at stop, the connections the kernel has already completed but nobody has accepted yet are
  accepted before the socket closes. Closing a listening socket resets everything still in its
  backlog: a client (a mesh peer's pool dialling a moment before a drain) that connected and sent
  its request would see the connection reset with no answer, which a forwarder must treat as
  "maybe processed" for a POST. Accepted, the request gets an answer: a draining router refuses it
  (marked for a peer, which sends it elsewhere). A connect that completes after this last accept
  and before the socket is closed, one reactor turn later, is still reset: the window shrinks from
  "anything queued" to that turn.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

_log = Logger(namespace="lchat.listener")


class Listener(Service):
    """Listens on ``endpoint`` with ``factory`` while running; see the module docstring."""

    def __init__(self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: IListeningPort | None = None
        self._listening: Deferred[Any] | None = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:
        super().startService()
        self._listen()

    def _listen(self) -> None:
        if self._listening is not None:
            return
        outcome: list[Any] = []
        self._listening = self.endpoint.listen(self.factory)
        self._listening.addBoth(outcome.append)
        if not outcome:
            # An endpoint that listens later (none of ours do): keep its result, log a failure.
            self._listening.addCallback(self._listened)
            self._listening.addErrback(
                lambda f: _log.failure("listening on {endpoint} failed", f, endpoint=self.endpoint)
            )
            return
        if isinstance(outcome[0], Failure):
            self._listening = None
            outcome[0].raiseException()  # the boot fails, naming why
        self._listened(outcome[0])

    def _listened(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        return port

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        port, self.port = self.port, None
        listening, self._listening = self._listening, None
        if port is None:
            if listening is not None:
                listening.cancel()
            return None
        accept_backlog(port)
        return port.stopListening()


def listen(
    parent: MultiService, endpoint: IStreamServerEndpoint, factory: IProtocolFactory
) -> Listener:
    """A listener under ``parent``: it fails the boot (rather than logging) when it cannot
    listen, and answers the connections already queued when it stops."""
    service = Listener(endpoint, factory)
    service.setServiceParent(parent)
    return service


def accept_backlog(port: object) -> None:
    """Accept what is queued on a listening port now (Twisted's TCP and UNIX ports accept in
    ``doRead``, as many as are queued, up to their batch size; with nothing queued it returns at
    once). A port that is not a readable descriptor is left alone."""
    do_read = getattr(port, "doRead", None)
    if do_read is None or not getattr(port, "connected", False):
        return
    try:
        do_read()
    except Exception:
        _log.failure("accepting the last queued connections of {port} failed", port=port)

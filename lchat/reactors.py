"""The reactor types lchat's constructors take: one per set of capabilities a seam needs.

**One capability: Twisted's interface.** A seam that only keeps time takes ``IReactorTime``; one
that only runs work in the reactor's thread pool, ``IReactorThreads``. mypy-zope checks them
nominally (every reactor declares them, ``task.Clock`` declares ``IReactorTime``), and they go
straight into Twisted's own APIs (``deferLater``, ``Deferred.addTimeout``, ``LoopingCall.clock``,
``deferToThreadPool``), which ask for exactly those interfaces.

**Several capabilities: a Protocol here.** Python has no intersection type, and zope interfaces
are nominal: a reactor declares ``IReactorTime`` and ``IReactorTCP`` separately, so no reactor is
an instance of an interface that extends both. Twisted's own make-believe intersections show it:
the global reactor is typed ``twisted.internet._IReactorCommon`` (core, time, FD set, TCP,
process; not UNIX, not threads), treq's ``reactor=`` wants ``treq._types._ITreqReactor`` (TCP,
time, name resolver), and neither is a subtype of the other, nor is any concrete reactor
(``PollReactor``, uvloop's, ``MemoryReactorClock``) a subtype of either. The Protocols below are
structural instead: each lists the methods its seams need, so the global reactor, ``PollReactor``,
uvloop's reactor and ``MemoryReactorClock`` fit wherever they have the methods, and mypy checks
both the caller (does its reactor have them?) and every call the seam makes on it.

**From a Protocol back to Twisted: adapt.** Twisted's APIs want interfaces, which a Protocol value
is not. Code holding a Protocol hands Twisted ``IReactorTime(reactor)`` (or ``IReactorTCP``, …):
zope adaptation returns the reactor itself when it declares the interface and raises
``TypeError`` when it does not, and mypy-zope types the result as the interface. The same idiom
serves a seam that needs an extra capability only on one path (an ACME order's worker thread
calling back: ``IReactorFromThreads(reactor)`` there), as Twisted's ``_IReactorCommon`` docstring
prescribes for the interfaces a reactor may lack. A checked conversion, not a cast; treq's
``_ITreqReactor``, which no reactor declares, is the one cast
(:func:`lchat.twisted_internals.treq_reactor`).

**A whole reactor: an intersection interface.** A composition root hands one reactor to features
of every kind: :class:`Reactor` extends every interface the reactors lchat runs on declare, so it
goes straight into every Twisted API and every seam, and fits every Protocol above. No reactor
declares it: :func:`whole` checks one provides each of those interfaces, :func:`installed` the
global one (whose static type, ``_IReactorCommon``, lacks UNIX and threads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from twisted.internet.interfaces import (
    IConnector,
    IDelayedCall,
    IReactorCore,
    IReactorPluggableNameResolver,
    IReactorProcess,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
    IReactorUNIX,
)
from twisted.internet.protocol import ClientFactory


class TimeReactor(Protocol):
    """``IReactorTime``'s two methods, as a Protocol: the base the others extend (a seam that
    needs only time takes ``IReactorTime`` itself). Parameters are positional-only, since
    reactors name them differently (``callable``, ``f``), and there is no ``**kwargs``: a keyword
    could then name a positional-only parameter, which no implementation accepts."""

    def callLater(
        self, delay: float, callable: Callable[..., Any], /, *args: object
    ) -> IDelayedCall: ...

    def seconds(self, /) -> float: ...


class TCPReactor(TimeReactor, Protocol):
    """Time and TCP: an HTTP client over TCP (S3, a peer's mesh API, an ACME CA, a feed)."""

    def connectTCP(
        self,
        host: str,
        port: int,
        factory: ClientFactory,
        timeout: float = 30.0,
        bindAddress: tuple[str, int] | None = None,
        /,
    ) -> IConnector: ...


class UNIXReactor(TimeReactor, Protocol):
    """Time and unix sockets: a request to the admin API or a space (:mod:`lchat.unixhttp`)."""

    def connectUNIX(
        self, address: str, factory: ClientFactory, timeout: float = 30, checkPID: bool = False, /
    ) -> IConnector: ...


class Reactor(
    IReactorCore,
    IReactorTime,
    IReactorTCP,
    IReactorUNIX,
    IReactorThreads,
    IReactorProcess,
    IReactorPluggableNameResolver,
):
    """A whole reactor, as a program's composition root holds it (``twistd lchat``, ``lchat
    space``, a CLI command's own reactor): every interface the reactors lchat runs on declare.
    An interface, so it goes wherever Twisted asks for one of them, and it fits every Protocol
    above. No reactor declares it: :func:`whole` checks one provides them all."""


def whole(reactor: object) -> Reactor:
    """``reactor``, checked to provide every interface :class:`Reactor` extends."""
    missing = [i.__name__ for i in Reactor.getBases() if not i.providedBy(reactor)]
    if missing:
        raise TypeError(f"{reactor!r} does not provide {', '.join(missing)}")
    return cast(Reactor, reactor)


def installed() -> Reactor:
    """The global reactor (installing Twisted's default if none is yet), as a :class:`Reactor`.
    Composition roots and tests only: everything else is handed one."""
    from twisted.internet import reactor

    return whole(reactor)

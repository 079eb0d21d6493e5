"""Deferred helpers shared by the services: one result watched by many (:func:`observe`,
:func:`settled`), one outcome handed to a batch of waiters (:func:`fire`, :func:`relay`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

T = TypeVar("T")


def observe(d: Deferred[T]) -> Deferred[T]:
    """A new Deferred with ``d``'s result, which stays on ``d`` for its other waiters.
    Cancelling the new one does not cancel ``d``; a failure handed on is not left unhandled on
    ``d`` (its chain goes on with None)."""
    waiter: Deferred[T] = Deferred()

    def passthrough(result: Any) -> Any:
        if not waiter.called:
            if isinstance(result, Failure):
                waiter.errback(result)
                return None
            waiter.callback(result)
        return result

    d.addBoth(passthrough)
    return waiter


def settled(d: Deferred[Any]) -> Deferred[None]:
    """A new Deferred firing (with None, never failing) when ``d`` does; ``d``'s own chain and
    result are untouched, so any number of waiters can watch one task."""
    out: Deferred[None] = Deferred()

    def fire(result: object) -> object:
        if not out.called:
            out.callback(None)
        return result

    d.addBoth(fire)
    return out


def fire(waiters: Iterable[Deferred[T]], result: T | Failure) -> None:
    """Hand one outcome to every waiter not fired yet (one that gave up was cancelled): a
    Failure errbacks each, anything else is each one's result."""
    for waiter in waiters:
        if waiter.called:
            continue
        if isinstance(result, Failure):
            waiter.errback(result)
        else:
            waiter.callback(result)


def relay(result: object, d: Deferred[None]) -> None:
    """Fire ``d`` as ``result`` says (a Failure errbacks it, anything else is None), unless it
    fired already: for ``addBoth`` when one waiter follows another's task."""
    fire([d], result if isinstance(result, Failure) else None)

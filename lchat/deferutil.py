"""Deferred helpers shared by the services."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure


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


def relay(result: object, d: Deferred[None]) -> None:
    """Fire ``d`` as ``result`` says (a Failure errbacks it, anything else is None), unless it
    fired already: for ``addBoth`` when one waiter follows another's task."""
    if d.called:
        return
    if isinstance(result, Failure):
        d.errback(result)
    else:
        d.callback(None)

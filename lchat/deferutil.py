"""Deferred helpers shared by the services."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred


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

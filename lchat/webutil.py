"""Small twisted.web pieces shared by the router's HTTP listeners."""

from __future__ import annotations

from typing import Any

from twisted.web import client
from twisted.web.http import Request
from twisted.web.server import Site


class QuietSite(Site):
    """A Site that writes no per-request access log (the router's own metrics and logs say more)."""

    noisy = False
    displayTracebacks = False

    def log(self, request: Request) -> None:
        pass


class _QuietClientFactory(client._HTTP11ClientFactory):
    noisy = False


def quiet_pool(reactor: Any, persistent: bool = True) -> client.HTTPConnectionPool:
    """A connection pool whose connections don't log "Starting factory" for every dial."""
    pool = client.HTTPConnectionPool(reactor, persistent=persistent)
    pool._factory = _QuietClientFactory
    return pool

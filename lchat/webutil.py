"""Small twisted.web pieces shared by the router's HTTP listeners."""

from __future__ import annotations

from typing import Any

from twisted.web.client import HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http import Request
from twisted.web.server import Site


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
